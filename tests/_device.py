"""The test suite's device switch: ``APEX_TEST_DEVICE=cuda`` runs every Triton-path test compiled on a GPU.

By default (``APEX_TEST_DEVICE`` unset or ``cpu``) the Triton kernels run on CPU tensors under the Triton
interpreter. With ``APEX_TEST_DEVICE=cuda`` the interpreter stays off, and while a test runs on the Triton
path (the ``backend_name`` fixture's ``"triton"`` case) tensors the test creates without naming a device
are created as on the CPU -- same values, same generators -- and moved to the GPU
(:class:`apex.testing.device.OnDevice`),
so the kernels are compiled and launched on the GPU. The PyTorch-path case stays on the CPU. Without a CUDA
device those cases are skipped, with the reason.

The interpreter's memory tracer cannot watch a compiled kernel: under the switch ``apex.testing.TritonTrace``
becomes :class:`LaunchCounter`, which counts launches and kernels the same way (a launch is one
``kernel[grid](...)``; an autotuned kernel's benchmarking runs are not counted) and skips the rest of a test
that asks for byte counts. Autotuned kernels keep two of their configs there (:func:`cap_autotuning`).

``APEX_TEST_DEVICE=meta`` checks, on a machine without a GPU, that the tests are ready for one
(:class:`MetaCheck`): the Triton-path cases run as under ``cuda`` but on the ``meta`` device, where tensors
move and devices propagate as on a GPU and nothing is computed. A Triton launch outside the switch, a CPU
tensor reaching a kernel, a CPU tensor mixed into an operation or argument check with device tensors, or
``.numpy()`` of a device tensor fails the test, as it would on a GPU. A test that gets past that and then needs
values is skipped with the point it reached, so what comes after its first read of a value is not checked;
nor is anything that depends on the GPU's own behaviour (autotuning, numerics)::

    APEX_TEST_DEVICE=meta python -m pytest tests -k triton -n 2
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apex.testing.device import OnDevice  # noqa: F401  (re-exported for conftest)

VALUES = ("cpu", "cuda", "meta")


def requested() -> str:
    value = os.environ.get("APEX_TEST_DEVICE", "cpu").strip().lower() or "cpu"
    if value not in VALUES:
        raise pytest.UsageError(f"APEX_TEST_DEVICE must be one of {VALUES}, got {value!r}")
    return value


def triton_device() -> tuple[torch.device | None, str]:
    """Where the Triton-path cases run: ``(device, "")``, or ``(None, reason)`` to skip them."""
    value = requested()
    if value != "cuda":
        return torch.device(value), ""
    if not torch.cuda.is_available():
        return None, "APEX_TEST_DEVICE=cuda, but no CUDA device is visible (torch.cuda.is_available() is False)"
    return torch.device("cuda", torch.cuda.current_device()), ""


class LaunchCounter:
    """``TritonTrace``'s interface for compiled kernels: ``launches`` and ``kernels`` are counted;
    ``watch`` does nothing (there are no addresses to check); byte counts skip the test from that point."""

    def __init__(self, bounds: bool = True, count: bool = True):
        self.launches = 0
        self.kernels: Counter = Counter()
        self._saved: dict = {}
        self._inside_autotuner = 0

    def watch(self, *tensors) -> LaunchCounter:
        return self

    @property
    def bytes_requested(self) -> int:
        pytest.skip("byte counts need the Triton interpreter (APEX_TEST_DEVICE=cpu); the checks before "
                    "this point passed on the GPU")

    bytes_unique = bytes_requested

    def __enter__(self) -> LaunchCounter:
        from triton.runtime import autotuner, jit

        saved = self._saved = {"jit": jit.JITFunction.run, "auto": autotuner.Autotuner.run}
        counter = self

        def jit_run(fn, *args, warmup=False, **kwargs):
            if not warmup and not counter._inside_autotuner:
                counter.launches += 1
                counter.kernels[fn.__name__] += 1
            return saved["jit"](fn, *args, warmup=warmup, **kwargs)

        def auto_run(tuner, *args, **kwargs):
            counter.launches += 1
            counter.kernels[getattr(tuner.fn, "__name__", "autotuned")] += 1
            counter._inside_autotuner += 1
            try:
                return saved["auto"](tuner, *args, **kwargs)
            finally:
                counter._inside_autotuner -= 1

        jit.JITFunction.run = jit_run
        autotuner.Autotuner.run = auto_run
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import autotuner, jit

        jit.JITFunction.run = self._saved["jit"]
        autotuner.Autotuner.run = self._saved["auto"]


@contextlib.contextmanager
def count_interpreted_launches() -> Iterator[list]:
    """The interpreter's launches while the block runs, as a list of one entry per event: every
    ``kernel[grid]`` and every direct ``kernel.run(...)`` (what the launch-plan paths call), so a test that
    replaces ``run`` with a stand-in (the host-cost stubs) still shows its launches."""
    from triton.runtime import interpreter, jit

    events: list = []
    patched = []
    for owner, name in ((jit.KernelInterface, "__getitem__"), (interpreter.InterpretedFunction, "run")):
        original = vars(owner).get(name)
        if original is None:
            continue

        def counting(*args, _original=original, **kwargs):
            events.append(1)
            return _original(*args, **kwargs)

        setattr(owner, name, counting)
        patched.append((owner, name, original))
    try:
        yield events
    finally:
        for owner, name, original in patched:
            setattr(owner, name, original)


def cap_autotuning() -> None:
    """Under ``APEX_TEST_DEVICE=cuda``: each ``triton.autotune`` kernel keeps at most
    ``APEX_TEST_AUTOTUNE_CONFIGS`` of its configs (default 2, spread over its list; ``0`` keeps all).

    OpenFold's LayerNorm kernels hold 24 configs each, and the autotuner compiles and times every one for
    each new ``(M, N)``: over the tests' many shapes that took minutes. With two configs a test still
    autotunes on the GPU (a timed choice, a cache to save and load) in a second or two.
    """
    value = os.environ.get("APEX_TEST_AUTOTUNE_CONFIGS", "").strip() or "2"
    if not value.isdigit():
        raise pytest.UsageError(f"APEX_TEST_AUTOTUNE_CONFIGS must be a whole number (0: all configs), got {value!r}")
    limit = int(value)
    if limit == 0:
        return
    from apex.contrib.openfold_triton._tuning import KERNELS  # the registry of the autotuned kernels

    for fn in KERNELS.get().values():
        configs = list(fn.configs)
        if len(configs) > limit:
            picks = sorted({round(i * (len(configs) - 1) / max(limit - 1, 1)) for i in range(limit)})
            fn.configs = [configs[i] for i in picks]


def _is_device_error(exc: BaseException) -> bool:
    """An error a GPU run raises too: CPU tensors (other than 0-dim ones) mixed with device tensors in an
    operation or an argument check, a CPU generator for a device tensor, ``.numpy()`` of a device tensor."""
    msg = str(exc).lower()
    return ("cpu" in msg and "meta" in msg) or "same device" in msg


class MetaCheck:
    """``APEX_TEST_DEVICE=meta``: every Triton launch is checked instead of run.

    A launch must come from a Triton-path case (inside the switch: ``in_case``) and get only device
    tensors; anything else fails the test at the launch. Meta tensors hold no data, so the kernel is not
    run, and the test carries on to its next launch; when it then needs values (``.item()``, a comparison)
    :meth:`outcome` turns that error into a skip naming how many launches passed the check.
    """

    def __init__(self) -> None:
        self.in_case = 0
        self.launches = 0
        self.counters: list[LaunchCounter] = []

    def install(self) -> None:
        from triton.runtime import interpreter as itp

        check = self

        def call(ex, *args, **kwargs):
            name = getattr(ex.fn, "__name__", "kernel")
            if not check.in_case:
                pytest.fail(f"Triton kernel {name} launched outside the device switch: under APEX_TEST_DEVICE=cuda "
                            "its tensors stay on the CPU; use the backend_name, device or triton_device fixture")
            host = [f"{key} {tuple(t.shape)} {t.dtype}" for key, t in _tensor_args(args, kwargs)
                    if t.device.type != "meta"]
            if host:
                pytest.fail(f"Triton kernel {name} got tensors that are on the CPU under APEX_TEST_DEVICE=cuda: "
                            f"{', '.join(host)}; create them inside the device switch (or with device=)")
            check.launches += 1
            for counter in check.counters:
                counter.launches += 1
                counter.kernels[name] += 1

        itp.GridExecutor.__call__ = call

    def outcome(self, exc: BaseException) -> None:
        """Called with a test's exception: re-raises what a GPU run would raise too, else skips."""
        if not isinstance(exc, Exception) or _is_device_error(exc):
            raise exc  # pytest's own outcomes (fail, skip) are BaseExceptions
        where = f"after {self.launches} checked Triton launches" if self.launches else "before any Triton launch"
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        pytest.skip(f"meta tensors hold no values: stopped {where} ({type(exc).__name__}: {first})")


class RealOpsOnMeta(TorchDispatchMode):
    """Runs apex's own custom ops (``apex::*``) on meta tensors: PyTorch would call their fake
    implementations there, which launch nothing. Autograd sits above this mode, so gradients still flow
    through the ops' backward formulas."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        opdef = _opdefs().get(func._schema.name) if func.namespace == "apex" else None
        if opdef is None:
            return func(*args, **kwargs)
        return opdef._init_fn(*args, **kwargs)


@contextlib.contextmanager
def autocast_as_cuda() -> Iterator[None]:
    """Autocast for the ``meta`` device is autocast for ``cuda`` (PyTorch rejects ``meta`` there): code that
    asks about, or switches off, autocast for its tensors' device type runs on meta tensors as on the GPU."""
    saved = torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype
    autocast, enabled, dtype = saved

    def cuda(device_type):
        return "cuda" if device_type == "meta" else device_type

    class Autocast(autocast):
        def __init__(self, device_type, *args, **kwargs):
            super().__init__(cuda(device_type), *args, **kwargs)

    torch.autocast = Autocast
    torch.is_autocast_enabled = lambda *args: enabled(*map(cuda, args))
    torch.get_autocast_dtype = lambda device_type: dtype(cuda(device_type))
    try:
        yield
    finally:
        torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype = saved


def _opdefs() -> dict:
    from torch._library.custom_ops import OPDEFS

    return OPDEFS


class MetaLaunchCounter(LaunchCounter):
    """``TritonTrace`` under ``APEX_TEST_DEVICE=meta``: counts the launches :class:`MetaCheck` checks."""

    def __enter__(self) -> MetaLaunchCounter:
        CHECK.counters.append(self)
        return self

    def __exit__(self, *exc) -> None:
        CHECK.counters.remove(self)

    @property
    def bytes_requested(self) -> int:
        pytest.skip(f"byte counts need the Triton interpreter; {CHECK.launches} Triton launches checked on meta")

    bytes_unique = bytes_requested


def _tensor_args(args, kwargs):
    for key, a in list(enumerate(args)) + list(kwargs.items()):
        t = getattr(a, "base", a)  # a host-side TensorDescriptor holds its tensor as .base
        if isinstance(t, torch.Tensor):
            yield key, t


CHECK = MetaCheck()
