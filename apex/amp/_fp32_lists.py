"""O1's function lists: Apex's lists (:mod:`apex.amp.lists`) applied on top of ``torch.autocast``.

CUDA autocast already runs softmax, the norms, the losses, ``exp``/``log``/``pow``, ``sum``/``mean`` and
the other reductions in fp32, as Apex's O1 did; CPU autocast leaves them in bf16/fp16. On the CPU, O1
therefore also wraps the functions of Apex's ``FP32_FUNCS`` lists (``torch``, ``torch.nn.functional`` and
``torch.Tensor``) so that, while O1 casting is active and autocast is on, their fp16/bf16 tensor arguments
are cast to fp32 (fp32 in, fp32 out; other arguments untouched). As in Apex, their in-place tensor
methods (``exp_``, ``pow_``, ...) raise on a half tensor, which they could not update in fp32, and the
``BANNED_FUNCS`` (``F.binary_cross_entropy``) raise on a half input unless ``amp.init(allow_banned=True)``.
Code running with autocast off (inside ``disable_casts()``, the optimizer step, apex's own fused ops) sees
the original functions' behaviour.

Two of Apex's rules have no counterpart in any device's autocast, so they are installed on CUDA as well
(:func:`patch_apex_rules`): the in-place methods of the fp32 functions raise on a half tensor (CUDA autocast
does not cast in-place calls: ``half.exp_()`` would run in half), and the banned functions raise
``NotImplementedError`` on a half input, or with ``allow_banned`` run in fp32 -- CUDA autocast refuses
``binary_cross_entropy`` with a ``RuntimeError`` whatever the input, Apex's O1 ran it on fp32 inputs.

The lists are read when O1 starts, so a user's edits to them count on every device (:func:`patch_edits`):
a name added to ``FP16_FUNCS`` or ``FP32_FUNCS`` runs in that precision, a name taken off both runs on its
arguments as they come, a name added to ``CASTS``/``SEQUENCE_CASTS`` promotes mixed arguments, an entry
added to ``BANNED_FUNCS`` raises on half inputs.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)

# CUDA autocast's fp32 functions that Apex's torch lists lack: on the CPU O1 runs them in fp32 too.
CPU_EXTRA_FP32 = ("log1p", "softmax", "log_softmax", "mean")
# Apex's O1 ran the RNNs and RNN cells in half (its rnn_compat casts); CUDA autocast has the cells in its
# lower-precision list, CPU autocast has neither them nor a half LSTM it can run (it sends LSTMs to oneDNN,
# which has no fp16 LSTM without AVX512-FP16). On the CPU O1 casts their float arguments (input, state and
# weights) to the half type and runs them with autocast off, where PyTorch picks a kernel that exists.
TORCH_VF_HALF = ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "lstm", "gru", "rnn_tanh", "rnn_relu")
# Apex's tensor FP32_FUNCS also has Tensor.cpu: a half tensor copied to the host arrives in fp32. Autocast has
# no such rule on any device, so this one is installed on CUDA as well (``patch_transfers``).
TENSOR_TRANSFERS_FP32 = ("cpu",)


def _lists() -> tuple:
    """``(module, its list module)`` for Apex's three list modules, read when O1 starts."""
    from apex.amp.lists import functional_overrides, tensor_overrides, torch_overrides

    return ((F, functional_overrides), (torch, torch_overrides), (torch.Tensor, tensor_overrides))


def _added(lists, name: str) -> list:
    """The entries of ``lists.<name>`` that were not there as shipped (a user's edit), in order."""
    shipped = set(lists._DEFAULTS[name])
    return [n for n in dict.fromkeys(getattr(lists, name)) if n not in shipped]


def _fp32_names(module, lists) -> list:
    """The functions of ``module`` that the CPU's fp32 wrapper takes: the shipped FP32 entries still listed
    (added ones get :func:`patch_edits`'s wrapper), CUDA autocast's extra fp32 functions where Apex's list
    is the torch one, less anything now in FP16_FUNCS and the transfer rule (``patch_transfers``)."""
    names = [n for n in lists.FP32_FUNCS if n in set(lists._DEFAULTS["FP32_FUNCS"])]
    if module is not F:
        names += CPU_EXTRA_FP32
    half = set(lists.FP16_FUNCS)
    return [n for n in dict.fromkeys(names) if n not in half and n not in TENSOR_TRANSFERS_FP32]


def _has_half(values) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if v.dtype in _HALF:
                return True
        elif isinstance(v, (list, tuple)) and _has_half(v):
            return True
    return False


def _upcast(value):
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _HALF else value
    if isinstance(value, (list, tuple)):
        return type(value)(_upcast(v) for v in value)
    return value


def _casting(handle) -> bool:
    return handle.is_active() and torch.is_autocast_enabled(handle.device_type)


def _fp32_wrapper(fn, handle):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _casting(handle) or not (_has_half(args) or _has_half(kwargs.values())):
            return fn(*args, **kwargs)
        out = kwargs.pop("out", None)
        result = fn(*_upcast(args), **{k: _upcast(v) for k, v in kwargs.items()})
        if out is None:
            return result
        # The caller's buffer gets the fp32 result (in its own dtype), as the call promised.
        if isinstance(out, torch.Tensor):
            return out.copy_(result)
        for o, r in zip(out, result):
            o.copy_(r)
        return out

    wrapper.__wrapped_amp__ = fn
    return wrapper


def _floats_to(value, dtype: torch.dtype):
    """``value``'s floating-point tensors (also inside lists and tuples) in ``dtype``; the rest as it is."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_floats_to(v, dtype) for v in value)
    return value


def _half_wrapper(fn, handle):
    def wrapper(*args, **kwargs):
        if not _casting(handle):
            return fn(*args, **kwargs)
        with torch.autocast(handle.device_type, enabled=False):
            return fn(*_floats_to(args, handle.dtype), **{k: _floats_to(v, handle.dtype) for k, v in kwargs.items()})

    wrapper.__wrapped_amp__ = fn
    return wrapper


def _banned_wrapper(fn, handle, message: str):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _casting(handle):
            return fn(*args, **kwargs)
        if _has_half(args) or _has_half(kwargs.values()):
            raise NotImplementedError(message)
        # fp32 inputs run as they come (Apex's O1); CUDA autocast would refuse the function outright.
        with torch.autocast(handle.device_type, enabled=False):
            return fn(*args, **kwargs)

    wrapper.__wrapped_amp__ = fn
    return wrapper


def _inplace_wrapper(fn, name: str, handle):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if _casting(handle) and isinstance(self, torch.Tensor) and self.dtype in _HALF:
            raise NotImplementedError(f"Cannot call in-place function {name} with fp16 arguments.")
        return fn(self, *args, **kwargs)

    wrapper.__wrapped_amp__ = fn
    return wrapper


def _edited_wrapper(fn, handle, dtype: torch.dtype | None):
    """A function a user moved between Apex's lists: while O1 casts, its floating-point arguments in ``dtype``
    (None: as they come, for a function taken off every list) and autocast off inside, so that the device's
    own autocast lists do not undo the move (softmax moved to FP16_FUNCS runs in half on CUDA too)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not _casting(handle):
            return fn(*args, **kwargs)
        if dtype is not None:
            args, kwargs = _floats_to(args, dtype), {k: _floats_to(v, dtype) for k, v in kwargs.items()}
        with torch.autocast(handle.device_type, enabled=False):
            return fn(*args, **kwargs)

    wrapper.__wrapped_amp__ = fn
    return wrapper


def _wrap(handle, module, name: str, make) -> None:
    orig = getattr(module, name, None)
    if orig is None:
        return
    handle._save_func(module, name, orig)
    setattr(module, name, make(orig))


def patch(handle, allow_banned: bool) -> None:
    """Wrap the lists' fp32, in-place and banned functions for ``handle`` on the CPU (restored by
    ``handle._deactivate``)."""
    lists = _lists()
    for module, mod_lists in lists:
        for name in _fp32_names(module, mod_lists):
            _wrap(handle, module, name, lambda fn: _fp32_wrapper(fn, handle))
    _inplace(handle, _fp32_names(torch, lists[1][1]))
    for name in TORCH_VF_HALF:
        _wrap(handle, torch._VF, name, lambda fn: _half_wrapper(fn, handle))
    for name, message in dict(lists[0][1].BANNED_FUNCS).items():
        _ban(handle, name, message, allow_banned)


def patch_apex_rules(handle, allow_banned: bool) -> None:
    """On CUDA (whose autocast has the fp32 lists themselves): Apex's in-place and banned-function rules for
    the shipped entries, which CUDA autocast does not have (added entries are :func:`patch_edits`')."""
    lists = _lists()
    functional, torch_lists = lists[0][1], lists[1][1]
    shipped = set(torch_lists._DEFAULTS["FP32_FUNCS"])
    half = set(torch_lists.FP16_FUNCS)
    _inplace(handle, [n for n in dict.fromkeys(torch_lists.FP32_FUNCS) if n in shipped and n not in half])
    shipped_banned = dict(functional._DEFAULTS["BANNED_FUNCS"])
    for name, message in dict(functional.BANNED_FUNCS).items():
        if name in shipped_banned:
            _ban(handle, name, message, allow_banned)


def _inplace(handle, fp32_names) -> None:
    """``torch.<name>_`` and ``Tensor.<name>_`` of each fp32 function raise on a half tensor (Apex's rule)."""
    for module in (torch, torch.Tensor):
        for name in fp32_names:
            _wrap(handle, module, name + "_", lambda fn, n=name + "_": _inplace_wrapper(fn, n, handle))


def _ban(handle, name: str, message: str, allow_banned: bool) -> None:
    """``F.<name>`` raises ``message`` on half inputs under O1, or with ``allow_banned`` runs in fp32 (Apex's)."""
    if allow_banned:
        _wrap(handle, F, name, lambda fn: _edited_wrapper(fn, handle, torch.float32))
    else:
        _wrap(handle, F, name, lambda fn: _banned_wrapper(fn, handle, message))


def patch_edits(handle, allow_banned: bool) -> None:
    """Apply a user's edits of Apex's lists on any device (the shipped entries are autocast's business on
    CUDA and :func:`patch`'s on the CPU)."""
    from apex.amp.amp import _promote_wrapper

    for module, lists in _lists():
        half, fp32 = set(lists.FP16_FUNCS), set(lists.FP32_FUNCS)
        for name in _added(lists, "FP16_FUNCS"):
            _wrap(handle, module, name, lambda fn: _edited_wrapper(fn, handle, handle.dtype))
        for name in _added(lists, "FP32_FUNCS"):
            if name not in half and name not in TENSOR_TRANSFERS_FP32:
                _wrap(handle, module, name, lambda fn: _edited_wrapper(fn, handle, torch.float32))
        for name in dict.fromkeys(lists._DEFAULTS["FP16_FUNCS"] + lists._DEFAULTS["FP32_FUNCS"]):
            if name not in half and name not in fp32 and name not in TENSOR_TRANSFERS_FP32:
                _wrap(handle, module, name, lambda fn: _edited_wrapper(fn, handle, None))
        for name in _added(lists, "CASTS") + _added(lists, "SEQUENCE_CASTS"):
            _wrap(handle, module, name, _promote_wrapper)
        if module is F and handle.device_type != "cpu":  # (the CPU's are all patch()'s)
            for name, message in dict(_added(lists, "BANNED_FUNCS")).items():
                _ban(handle, name, message, allow_banned)


def patch_transfers(handle) -> None:
    """Wrap ``Tensor.cpu`` (Apex's fp32 transfer rule) for ``handle`` on every device, while it is listed."""
    from apex.amp.lists import tensor_overrides

    for name in TENSOR_TRANSFERS_FP32:
        if name in tensor_overrides.FP32_FUNCS:
            _wrap(handle, torch.Tensor, name, lambda fn: _fp32_wrapper(fn, handle))
