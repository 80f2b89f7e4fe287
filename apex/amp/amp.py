"""O1's user-function casting: decorators (``half_function``, ``bfloat16_function``, ``float_function``,
``promote_function``), their registry forms, and the legacy ``amp.init``.

The decorators act only while O1 casting is active (after ``amp.initialize(..., opt_level="O1")`` and
outside ``disable_casts()``); otherwise the function runs untouched, as in Apex.

* ``half_function``: floating-point tensor arguments are cast to the half dtype of the run (fp16, or bf16
  on CPUs unless chosen otherwise), and the body runs with autocast still on.
* ``bfloat16_function``: the same with bf16 whatever the run's half dtype.
* ``float_function``: arguments are cast to fp32 and the body runs with autocast off, so it really runs in
  fp32 (the documented purpose: numerically sensitive user code).
* ``promote_function``: when the floating-point tensor arguments have different dtypes, all of them are
  cast to the widest one (fp32 wins); otherwise they are left alone.

Tensors inside lists and tuples passed as arguments are cast too; other values pass through.
"""

from __future__ import annotations

import functools

import torch

from apex.amp.handle import AmpHandle, NoOpHandle

_DECORATOR_HANDLE = None
# Lists rather than Apex's sets: any object with the attribute may be registered, hashable or not.
_USER_CAST_REGISTRY: list = []
_USER_PROMOTE_REGISTRY: list = []


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _float_dtypes(values, out: set) -> set:
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.is_floating_point():
                out.add(v.dtype)
        elif isinstance(v, (list, tuple)):
            _float_dtypes(v, out)
    return out


def _active_handle():
    handle = _DECORATOR_HANDLE
    return handle if handle is not None and handle.is_active() else None


def _cast_wrapper(fn, kind: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        handle = _active_handle()
        if handle is None:
            return fn(*args, **kwargs)
        if kind == "float":
            args, kwargs = _cast(args, torch.float32), {k: _cast(v, torch.float32) for k, v in kwargs.items()}
            with torch.autocast(handle.device_type, enabled=False):
                return fn(*args, **kwargs)
        dtype = handle.dtype if kind == "half" else torch.bfloat16
        args, kwargs = _cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    wrapper.__wrapped_amp__ = fn
    return wrapper


def _promote_wrapper(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _active_handle() is None:
            return fn(*args, **kwargs)
        dtypes = _float_dtypes(list(args) + list(kwargs.values()), set())
        if len(dtypes) <= 1:
            return fn(*args, **kwargs)
        widest = torch.float64 if torch.float64 in dtypes else torch.float32
        args, kwargs = _cast(args, widest), {k: _cast(v, widest) for k, v in kwargs.items()}
        return fn(*args, **kwargs)

    wrapper.__wrapped_amp__ = fn
    return wrapper


def half_function(fn):
    """Decorator: run ``fn`` on half-precision inputs under O1."""
    return _cast_wrapper(fn, "half")


def bfloat16_function(fn):
    """Decorator: run ``fn`` on bf16 inputs under O1."""
    return _cast_wrapper(fn, "bfloat16")


def float_function(fn):
    """Decorator: run ``fn`` in fp32 (inputs cast to fp32, autocast off inside) under O1."""
    return _cast_wrapper(fn, "float")


def promote_function(fn):
    """Decorator: cast mixed-precision inputs of ``fn`` to the widest floating type under O1."""
    return _promote_wrapper(fn)


def _check_registrable(module, name) -> None:
    if not hasattr(module, name):
        raise ValueError(f"No function named {name} in module {module}.")


def _register(registry: list, entry: tuple) -> None:
    for i, old in enumerate(registry):
        if old[0] is entry[0] and old[1] == entry[1]:
            registry[i] = entry  # the last registration of a name wins
            return
    registry.append(entry)


def register_half_function(module, name: str) -> None:
    """Make ``module.name`` a half function once ``amp.initialize`` (O1) runs. Call before initialize."""
    _check_registrable(module, name)
    _register(_USER_CAST_REGISTRY, (module, name, "half"))


def register_bfloat16_function(module, name: str) -> None:
    """Make ``module.name`` a bf16 function once ``amp.initialize`` (O1) runs. Call before initialize."""
    _check_registrable(module, name)
    _register(_USER_CAST_REGISTRY, (module, name, "bfloat16"))


def register_float_function(module, name: str) -> None:
    """Make ``module.name`` an fp32 function once ``amp.initialize`` (O1) runs. Call before initialize."""
    _check_registrable(module, name)
    _register(_USER_CAST_REGISTRY, (module, name, "float"))


def register_promote_function(module, name: str) -> None:
    """Make ``module.name`` a promote function once ``amp.initialize`` (O1) runs. Call before initialize."""
    _check_registrable(module, name)
    _register(_USER_PROMOTE_REGISTRY, (module, name))


def _apply_registry(handle) -> None:
    for module, name, kind in list(_USER_CAST_REGISTRY):
        orig = getattr(module, name)
        handle._save_func(module, name, orig)
        setattr(module, name, _cast_wrapper(orig, kind))
    _USER_CAST_REGISTRY.clear()
    for module, name in list(_USER_PROMOTE_REGISTRY):
        orig = getattr(module, name)
        handle._save_func(module, name, orig)
        setattr(module, name, _promote_wrapper(orig))
    _USER_PROMOTE_REGISTRY.clear()


def _default_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init(enabled: bool = True, loss_scale="dynamic", enable_caching: bool = True, verbose: bool = False,
         allow_banned: bool = False, patch_type: torch.dtype | None = None, *, device_type: str | None = None,
         dtype: torch.dtype | None = None):
    """Switch O1 casting on and return the handle (Apex's pre-``initialize`` entry point, with its
    arguments in its order).

    ``patch_type`` (Apex's name) or ``dtype``: the low-precision type, fp16 by default on CUDA and bf16
    on the CPU (fp16 there too with the environment variable ``APEX_AMP_CPU_HALF=fp16``).
    ``amp.initialize(..., opt_level="O1")`` calls this; direct use is only for legacy scripts.
    """
    if patch_type is not None:
        if dtype is not None and dtype != patch_type:
            raise ValueError(f"patch_type={patch_type} and dtype={dtype} disagree; give one of them")
        dtype = patch_type
    if dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"patch_type must be torch.float16 or torch.bfloat16, got {dtype!r}")
    global _DECORATOR_HANDLE
    from apex.amp._amp_state import _amp_state, default_half_dtype

    old = getattr(_amp_state, "handle", None)
    if old is not None:
        old._deactivate()
    if not enabled:
        handle = NoOpHandle()
        _DECORATOR_HANDLE = handle
        _amp_state.handle = handle
        return handle
    device_type = device_type or _default_device_type()
    if dtype is None:
        dtype = default_half_dtype(device_type)  # CPU: bf16 unless APEX_AMP_CPU_HALF=fp16
    handle = AmpHandle(loss_scale, enable_caching, verbose, device_type=device_type, dtype=dtype)
    _apply_registry(handle)
    from apex.amp import _fp32_lists

    if device_type == "cpu":  # CUDA autocast has these lists itself...
        _fp32_lists.patch(handle, allow_banned)
    else:  # ...but not Apex's in-place and banned-function rules
        _fp32_lists.patch_apex_rules(handle, allow_banned)
    _fp32_lists.patch_edits(handle, allow_banned)  # a user's edits of Apex's lists, on every device
    _fp32_lists.patch_transfers(handle)  # ...but no device's autocast has Apex's Tensor.cpu rule
    handle._activate()
    _DECORATOR_HANDLE = handle
    _amp_state.handle = handle
    return handle
