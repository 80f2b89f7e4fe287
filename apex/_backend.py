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
from collections.abc import Iterator

import torch

BACKENDS = ("auto", "torch", "triton")

_override: contextvars.ContextVar[str | None] = contextvars.ContextVar("apex_backend", default=None)
# Set by apex.testing.triton_compile: launches on CPU tensors compile for a GPU target and run nothing.
_compile_only: contextvars.ContextVar[bool] = contextvars.ContextVar("apex_compile_only", default=False)


def _validate(name: object, source: str) -> str:
    if not isinstance(name, str) or name.lower() not in BACKENDS:
        raise ValueError(f"{source} must be one of {BACKENDS}, got {name!r}")
    return name.lower()


def _env_getter(name: str):
    """A function returning the environment variable ``name``'s current value (None when unset).

    Asked on every op call, so that a variable set later (``monkeypatch.setenv``, a launcher script) still
    counts: ``os.environ.get`` encodes the key and decodes the value each time (~1 µs), while a lookup of the
    pre-encoded key in the mapping ``os.environ`` keeps (``_data``, which every change made through
    ``os.environ`` updates) costs a dict lookup. The raw value then keys a cache of what it means."""
    data, encode = getattr(os.environ, "_data", None), getattr(os.environ, "encodekey", None)
    if isinstance(data, dict) and encode is not None:
        key = encode(name)
        return lambda: data.get(key)
    return lambda: os.environ.get(name)


_backend_env = _env_getter("APEX_BACKEND")
_interpret_env = _env_getter("TRITON_INTERPRET")
_env_cache: dict[object, str] = {}  # APEX_BACKEND's raw value -> its validated name
_interpret_cache: dict[object, bool] = {}  # TRITON_INTERPRET's raw value -> on or off


def current_backend() -> str:
    """The requested backend name (``auto``, ``torch`` or ``triton``), before resolution for tensors."""
    name = _override.get()
    if name is not None:
        return name
    raw = _backend_env()
    name = _env_cache.get(raw)
    if name is None:
        env = (os.fsdecode(raw) if isinstance(raw, bytes) else raw or "").strip()
        name = _validate(env, "APEX_BACKEND") if env else "auto"
        _env_cache[raw] = name
    return name


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
    return _resolve(t.is_cuda, t)


def select_device(device_type: str) -> str:
    """:func:`select` for tensors of ``device_type`` (``"cuda"``, ``"cpu"``, ...)."""
    return _resolve(device_type == "cuda", device_type)


def _resolve(on_gpu: bool, where: torch.Tensor | str | None) -> str:
    # Called on every op call: reads the request and, only for an error, the device's name.
    requested = current_backend()
    if requested == "torch":
        return "torch"
    if requested == "auto":
        return "triton" if on_gpu and triton_available() else "torch"
    # requested == "triton"
    if not triton_available():
        raise RuntimeError("APEX_BACKEND=triton was requested but triton is not installed "
                           "(pip install 'apex[triton]')")
    if not on_gpu and not interpreting() and not _compile_only.get():
        dt = where.device.type if isinstance(where, torch.Tensor) else where
        where = "CPU tensors" if dt is None or dt == "cpu" else f"{dt} tensors"
        raise RuntimeError(f"the triton backend cannot run on {where} unless the Triton interpreter is on "
                           "(set TRITON_INTERPRET=1 before importing apex kernels)")
    return "triton"


@contextlib.contextmanager
def compile_only_mode() -> Iterator[None]:
    """Let ``triton`` be selected for CPU tensors without the interpreter: only for
    :func:`apex.testing.triton_compile.compile_only`, where a launch compiles for a GPU and runs nothing."""
    token = _compile_only.set(True)
    try:
        yield
    finally:
        _compile_only.reset(token)
