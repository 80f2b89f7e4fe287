"""Choice between the Triton kernel path and the PyTorch path, made when an op is called.

Order of precedence: the innermost ``apex.backend(...)`` context, then the ``APEX_BACKEND`` environment
variable (``auto``, ``torch`` or ``triton``), then ``auto``. ``auto`` picks Triton for CUDA/ROCm tensors
when Triton is installed and PyTorch otherwise. ``triton`` on CPU tensors is allowed only when the Triton
interpreter is on (``TRITON_INTERPRET=1``), which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import os
from collections.abc import Callable, Iterator

import torch

BACKENDS = ("auto", "torch", "triton")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("apex_backend", default=None)
# Set by apex.testing.triton_compile: launches on CPU tensors compile for a GPU target and run nothing.
_compile_only: contextvars.ContextVar[bool] = contextvars.ContextVar("apex_compile_only", default=False)


def _validate(name: object, source: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name.lower()


def _env_lookup(name: str) -> tuple[Callable[[object], object], object]:
    """``(get, key)``: ``get(key)`` is the environment variable ``name``'s current value (None when unset).

    Asked on every op call, so that a variable set later (``monkeypatch.setenv``, a launcher script) still
    counts: ``os.environ.get`` encodes the key and decodes the value each time (~1 µs), while a lookup of the
    pre-encoded key in the mapping ``os.environ`` keeps (``_data``, which every change made through
    ``os.environ`` updates) costs a dict lookup. The raw value then keys a cache of what it means."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        return data.get, encode(name)
    return os.environ.get, name


_backend_get, _BACKEND_KEY = _env_lookup("APEX_BACKEND")
_interpret_get, _INTERPRET_KEY = _env_lookup("TRITON_INTERPRET")
_env_cache: dict[object, str] = {}  # APEX_BACKEND's raw value -> its validated name
_interpret_cache: dict[object, bool] = {}  # TRITON_INTERPRET's raw value -> on or off


def _backend_env() -> object:
    return _backend_get(_BACKEND_KEY)


def _interpret_env() -> object:
    return _interpret_get(_INTERPRET_KEY)


def _env_request(raw: object) -> str:
    """What APEX_BACKEND's raw value ``raw`` asks for (``ValueError`` for a bad name, raised at each call)."""
    name = _env_cache.get(raw)
    if name is None:
        env = (os.fsdecode(raw) if isinstance(raw, bytes) else raw or "").strip()
        name = _validate(env, "APEX_BACKEND") if env else "auto"
        _env_cache[raw] = name
    return name


def current_backend() -> str:
    """The requested backend name (``auto``, ``torch`` or ``triton``), before resolution for tensors."""
    name = _override.get()
    return name if name is not None else _env_request(_backend_env())


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Force a backend inside a ``with`` block: ``with apex.backend("torch"): ...``."""
    token = _override.set(_validate(name, "backend"))
    try:
        yield
    finally:
        _override.reset(token)


_has_triton: list[bool] = []


def triton_available() -> bool:
    # Asked on every op call with a CUDA tensor: looked up once.
    if not _has_triton:
        _has_triton.append(importlib.util.find_spec("triton") is not None)
    return _has_triton[0]


def interpreting() -> bool:
    """True when Triton kernels run under the interpreter (``TRITON_INTERPRET=1``)."""
    raw = _interpret_env()
    on = _interpret_cache.get(raw)
    if on is None:
        value = os.fsdecode(raw) if isinstance(raw, bytes) else raw or "0"
        on = _interpret_cache[raw] = value.lower() in ("1", "true", "yes", "on")
    return on


def _first_tensor(tensors) -> torch.Tensor | None:
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t
        if isinstance(t, (list, tuple)):
            found = _first_tensor(t)
            if found is not None:
                return found
    return None


def select(*tensors) -> str:
    """Resolve the backend (``"torch"`` or ``"triton"``) for an op on ``tensors``.

    ``tensors`` may contain tensors and (nested) lists of tensors; the first one found decides the device.
    """
    t = _first_tensor(tensors)
    return _resolve(t is not None and t.is_cuda, t)


def select_tensor(t: torch.Tensor) -> str:
    """:func:`select` for one tensor (an op's first argument): no search through the arguments."""
    # _resolve's kept answer, inline (the most frequent caller: a frame less); anything else is _resolve's.
    on_gpu = t.is_cuda
    plan = _plans_get(_override_get() or _backend_get(_BACKEND_KEY), _NO_PLAN)
    if plan[2] is triton_available:
        answer = plan[1] if on_gpu else plan[0]
        if answer is _INTERPRETED:
            if _interpret_get(_INTERPRET_KEY) is plan[3] or _compile_only_get():
                return "triton"
        elif answer is not None:
            return answer
    return _resolve_slow(on_gpu, t)


def select_device(device_type: str) -> str:
    """:func:`select` for tensors of ``device_type`` (``"cuda"``, ``"cpu"``, ...)."""
    return _resolve(device_type == "cuda", device_type)


# ------------------------------------------------------------------------------------- the resolution
# Every op call resolves, so the answer is kept per request: the request is the override's name, or, with
# none, APEX_BACKEND's raw value (bytes on POSIX; on Windows a str, which can equal an override's name only
# where it means that name). Keyed by the values read at each call rather than invalidated by ``backend()``:
# a thread's override (a contextvar) never reads another thread's answer, and the environment is still read
# at each call (a dict lookup). A plan is ``(answer on CPU tensors, answer on GPU tensors, triton_available,
# interpreter)``: each answer "torch", "triton", None (not asked yet) or _INTERPRETED ("triton" where the
# interpreter or compile-only mode is on, both asked at each call as before: TRITON_INTERPRET's raw value is
# compared with ``interpreter``, the last raw value found on, by identity; another one is asked again); the
# function ``triton_available`` the plan was made with, so that a replaced one (a test's monkeypatch) is asked
# again. An error is never kept: it is raised at each call.
_INTERPRETED = object()
_UNSEEN = object()  # (no raw value of TRITON_INTERPRET is this)
_NO_PLAN = (None, None, None, _UNSEEN)
_plans: dict[object, tuple] = {}
_plans_get = _plans.get
_override_get = _override.get
_compile_only_get = _compile_only.get


def _resolve(on_gpu: bool, where: torch.Tensor | str | None) -> str:
    # The kept answer (a few C calls, no other Python frame; select_tensor has a copy); the first call of a
    # request, an error, a replaced triton_available, an interpreter not known to be on: _resolve_slow.
    plan = _plans_get(_override_get() or _backend_get(_BACKEND_KEY), _NO_PLAN)
    if plan[2] is triton_available:
        answer = plan[1] if on_gpu else plan[0]
        if answer is _INTERPRETED:
            if _interpret_get(_INTERPRET_KEY) is plan[3] or _compile_only_get():
                return "triton"
        elif answer is not None:
            return answer
    return _resolve_slow(on_gpu, where)


def _resolve_slow(on_gpu: bool, where: torch.Tensor | str | None) -> str:
    """:func:`_resolve` asking everything (the request and, only for an error, the device's name); keeps the
    answer in the request's plan."""
    available = triton_available  # (read once: the plan says which function it asked)
    override = _override.get()
    key = override or _backend_env()
    requested = override if override is not None else _env_request(key)
    interpreter = _UNSEEN
    if requested == "torch":
        answer = "torch"
    elif requested == "auto":
        answer = "triton" if on_gpu and available() else "torch"
    else:  # requested == "triton"
        if not available():
            raise RuntimeError("APEX_BACKEND=triton was requested but triton is not installed "
                               "(pip install 'apex[triton]')")
        answer = "triton"
        if not on_gpu:
            raw = _interpret_env()
            if not interpreting() and not _compile_only.get():
                dt = where.device.type if isinstance(where, torch.Tensor) else where
                where = "CPU tensors" if dt is None or dt == "cpu" else f"{dt} tensors"
                raise RuntimeError(f"the triton backend cannot run on {where} unless the Triton interpreter is "
                                   "on (set TRITON_INTERPRET=1 before importing apex kernels)")
            answer = _INTERPRETED
            if _interpret_cache.get(raw):  # (interpreting() read the same value, unless a thread set another)
                interpreter = raw
    plan = _plans_get(key, _NO_PLAN)
    if plan[2] is not available:
        plan = (None, None, available, _UNSEEN)
    if interpreter is _UNSEEN:
        interpreter = plan[3]
    _plans[key] = (plan[0], answer, available, interpreter) if on_gpu else (answer, plan[1], available,
                                                                            interpreter)
    return "triton" if answer is _INTERPRETED else answer


@contextlib.contextmanager
def compile_only_mode() -> Iterator[None]:
    """Let ``triton`` be selected for CPU tensors without the interpreter: only for
    :func:`apex.testing.triton_compile.compile_only`, where a launch compiles for a GPU and runs nothing."""
    token = _compile_only.set(True)
    try:
        yield
    finally:
        _compile_only.reset(token)
