"""apex._backend's kept answers: every op call resolves the backend from a plan per request (the override's
name or APEX_BACKEND's raw value), so these check that a kept answer never outlives what it was made from
(the environment read at each call, the interpreter, compile-only mode, a replaced ``triton_available``, another
thread's override) and that every answer and error is the one the full resolution gives."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch

import apex
from apex import _backend


def _reference(on_gpu: bool, where) -> str:
    """The resolution asked in full at each call (the logic the kept answers stand for)."""
    requested = _backend.current_backend()
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if on_gpu and _backend.triton_available() else "torch"
    if not _backend.triton_available():
        raise RuntimeError("APEX_BACKEND=triton was requested but triton is not installed "
                           "(pip install 'apex[triton]')")
    if not on_gpu and not _backend.interpreting() and not _backend._compile_only.get():
        dt = where.device.type if isinstance(where, torch.Tensor) else where
        where = "CPU tensors" if dt is None or dt == "cpu" else f"{dt} tensors"
        raise RuntimeError(f"the triton backend cannot run on {where} unless the Triton interpreter is on "
                           "(set TRITON_INTERPRET=1 before importing apex kernels)")
    return "triton"


def _outcome(fn, *args):
    try:
        return fn(*args)
    except (RuntimeError, ValueError) as exc:
        return type(exc), str(exc)


class _FakeCuda:
    """What select_tensor reads of a tensor on a GPU (``is_cuda``), without one."""

    is_cuda = True


def test_every_state_answers_as_the_full_resolution(monkeypatch):
    # Every combination of what the answer depends on, visited in a shuffled order and each asked twice: the
    # second call (and a revisit after other states) takes the kept answer.
    states = list(itertools.product(
        (None, "auto", "torch", "triton"),                       # override
        (None, "", "torch", " TRITON ", "auto", "fast"),        # APEX_BACKEND (None: unset)
        (None, "0", "1", "on"),                                  # TRITON_INTERPRET
        (False, True),                                           # compile-only mode
        (True, False),                                           # triton available
    ))
    random.Random(0).shuffle(states)
    real_available = _backend.triton_available
    unavailable = lambda: False  # noqa: E731 (one function: replaced once, then kept)
    cpu = torch.ones(1)
    for override, env, interp, compile_only, available in states:
        for name, value in (("APEX_BACKEND", env), ("TRITON_INTERPRET", interp)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        monkeypatch.setattr(_backend, "triton_available", real_available if available else unavailable)
        with (apex.backend(override) if override else _null()), \
                (_backend.compile_only_mode() if compile_only else _null()):
            for _ in range(2):
                state = (override, env, interp, compile_only, available)
                for on_gpu, where in ((False, cpu), (True, cpu), (False, "meta"), (False, None)):
                    assert _outcome(_backend._resolve, on_gpu, where) == _outcome(_reference, on_gpu, where), state
                assert _outcome(_backend.select_tensor, cpu) == _outcome(_reference, False, cpu), state
                assert _outcome(_backend.select_tensor, _FakeCuda()) == _outcome(_reference, True, None), state
                assert _outcome(_backend.select, [cpu]) == _outcome(_reference, False, cpu), state
                assert _outcome(_backend.select_device, "cuda") == _outcome(_reference, True, "cuda"), state
                assert _outcome(_backend.select_device, "xpu") == _outcome(_reference, False, "xpu"), state


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def test_environment_is_read_at_each_call_after_an_answer_is_kept(monkeypatch):
    monkeypatch.delenv("APEX_BACKEND", raising=False)
    assert _backend._resolve(True, "cuda") == _reference(True, "cuda")
    monkeypatch.setenv("APEX_BACKEND", "torch")
    assert _backend._resolve(True, "cuda") == "torch"
    monkeypatch.setenv("APEX_BACKEND", "bogus")
    for _ in range(2):  # an error is not kept
        with pytest.raises(ValueError, match="APEX_BACKEND"):
            _backend.select_tensor(torch.ones(1))
    monkeypatch.setenv("APEX_BACKEND", "auto")
    assert _backend.select_tensor(torch.ones(1)) == "torch"


def test_interpreter_is_asked_at_each_call(monkeypatch):
    if not _backend.triton_available():
        pytest.skip("triton not installed")
    x = torch.ones(1)
    with apex.backend("triton"):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert _backend.select_tensor(x) == "triton"
        assert _backend.select_tensor(x) == "triton"  # (kept)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        for _ in range(2):
            with pytest.raises(RuntimeError, match="CPU tensors unless the Triton interpreter is on"):
                _backend.select_tensor(x)
        with _backend.compile_only_mode():
            assert _backend.select_tensor(x) == "triton"
        with pytest.raises(RuntimeError, match="meta tensors"):
            _backend.select_device("meta")
        monkeypatch.setenv("TRITON_INTERPRET", "yes")  # another value that means on
        assert _backend.select_tensor(x) == "triton"
        assert _backend.select_tensor(x) == "triton"


def test_a_replaced_triton_available_is_asked_without_reentering_the_override(monkeypatch):
    if not _backend.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("APEX_BACKEND", raising=False)
    with apex.backend("triton"):
        assert _backend.select_tensor(torch.ones(1)) == "triton"
        assert _backend._resolve(True, "cuda") == "triton"
        monkeypatch.setattr(_backend, "triton_available", lambda: False)
        with pytest.raises(RuntimeError, match="not installed"):
            _backend.select_tensor(torch.ones(1))
    assert _backend._resolve(True, "cuda") == "torch"  # auto: no triton, no kernels
    monkeypatch.undo()
    assert _backend._resolve(True, "cuda") == _reference(True, "cuda")


def test_each_thread_keeps_its_own_override(monkeypatch):
    if not _backend.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("APEX_BACKEND", raising=False)
    barrier, seen, errors = threading.Barrier(3), {}, []

    def worker(name):
        try:
            with (apex.backend(name) if name else _null()):
                barrier.wait()
                seen[name] = {_backend.select_tensor(torch.ones(1)) for _ in range(200)}
                barrier.wait()
        except BaseException as exc:  # (reported by the main thread)
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("torch", "triton", None)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert seen == {"torch": {"torch"}, "triton": {"triton"}, None: {"torch"}}


def test_nested_overrides_and_their_exit(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("APEX_BACKEND", "torch")
    x = torch.ones(1)
    assert _backend.select_tensor(x) == "torch"
    with apex.backend("triton"):
        assert _backend.select_tensor(x) == "triton"
        with apex.backend("auto"):
            assert _backend.select_tensor(x) == "torch"
            assert _backend._resolve(True, "cuda") == ("triton" if _backend.triton_available() else "torch")
            with apex.backend("torch"):
                assert _backend._resolve(True, "cuda") == "torch"
        assert _backend.select_tensor(x) == "triton"
    assert _backend.select_tensor(x) == "torch"
    assert _backend._resolve(True, "cuda") == "torch"
