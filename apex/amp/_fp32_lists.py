"""O1's fp32, half and banned functions where ``torch.autocast`` has none: Apex's lists, applied on the CPU.

CUDA autocast already runs softmax, the norms, the losses, ``exp``/``log``/``pow``, ``sum``/``mean`` and
the other reductions in fp32, as Apex's O1 did; CPU autocast leaves them in bf16/fp16. On the CPU, O1
therefore also wraps the functions of Apex's ``FP32_FUNCS`` lists (``torch``, ``torch.nn.functional`` and
``torch.Tensor``) so that, while O1 casting is active and autocast is on, their fp16/bf16 tensor arguments
are cast to fp32 (fp32 in, fp32 out; other arguments untouched). As in Apex, their in-place tensor
methods (``exp_``, ``pow_``, ...) raise on a half tensor, which they could not update in fp32, and
``F.binary_cross_entropy`` on a half input raises unless ``amp.init(allow_banned=True)``. Code running
with autocast off (inside ``disable_casts()``, the optimizer step, apex's own fused ops) sees the
original functions' behaviour.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)

FUNCTIONAL_FP32 = (
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu", "layer_norm",
    "group_norm", "local_response_norm", "normalize", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss",
    "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss", "ctc_loss",
)
TORCH_FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "softmax", "log_softmax", "cumprod", "cumsum", "dist", "mean", "norm", "prod", "std",
    "sum", "var", "renorm",
)
TENSOR_FP32 = TORCH_FP32 + ("__pow__", "__rpow__", "__ipow__")
# Apex's O1 ran the RNNs and RNN cells in half (its rnn_compat casts); CUDA autocast has the cells in its
# lower-precision list, CPU autocast has neither them nor a half LSTM it can run (it sends LSTMs to oneDNN,
# which has no fp16 LSTM without AVX512-FP16). On the CPU O1 casts their float arguments (input, state and
# weights) to the half type and runs them with autocast off, where PyTorch picks a kernel that exists.
TORCH_VF_HALF = ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell", "lstm", "gru", "rnn_tanh", "rnn_relu")
# Apex's O1 also lists Tensor.cpu: a half tensor copied to the host arrives in fp32. Autocast has no such
# rule on any device, so this wrapper is installed on CUDA as well (``patch_transfers``).
TENSOR_TRANSFERS_FP32 = ("cpu",)

BANNED_MESSAGE = (
    "amp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` It requires that "
    "the output of the previous function be already a FloatTensor. \n\nMost models have a Sigmoid right "
    "before BCELoss. In that case, you can use\n    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss "
    "into a single layer that is compatible with amp.\nAnother option is to add\n    "
    "amp.register_float_function(torch, 'sigmoid')\nbefore calling `amp.init()`.\nIf you _really_ know what "
    "you are doing, you can disable this warning by passing allow_banned=True to `amp.init()`.")


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


def _to_half(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_half(v, dtype) for v in value)
    return value


def _half_wrapper(fn, handle):
    def wrapper(*args, **kwargs):
        if not _casting(handle):
            return fn(*args, **kwargs)
        with torch.autocast(handle.device_type, enabled=False):
            return fn(*_to_half(args, handle.dtype), **{k: _to_half(v, handle.dtype) for k, v in kwargs.items()})

    wrapper.__wrapped_amp__ = fn
    return wrapper


def _banned_wrapper(fn, handle):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _casting(handle) and (_has_half(args) or _has_half(kwargs.values())):
            raise NotImplementedError(BANNED_MESSAGE)
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


def patch(handle, allow_banned: bool) -> None:
    """Wrap the lists' functions for ``handle`` (restored by ``handle._deactivate``)."""
    for module, names in ((F, FUNCTIONAL_FP32), (torch, TORCH_FP32), (torch.Tensor, TENSOR_FP32)):
        for name in names:
            orig = getattr(module, name, None)
            if orig is None:
                continue
            handle._save_func(module, name, orig)
            setattr(module, name, _fp32_wrapper(orig, handle))
    for module in (torch, torch.Tensor):
        for name in TORCH_FP32:
            orig = getattr(module, name + "_", None)
            if orig is not None:
                handle._save_func(module, name + "_", orig)
                setattr(module, name + "_", _inplace_wrapper(orig, name + "_", handle))
    for name in TORCH_VF_HALF:
        orig = getattr(torch._VF, name, None)
        if orig is not None:
            handle._save_func(torch._VF, name, orig)
            setattr(torch._VF, name, _half_wrapper(orig, handle))
    if not allow_banned:
        orig = F.binary_cross_entropy
        handle._save_func(F, "binary_cross_entropy", orig)
        F.binary_cross_entropy = _banned_wrapper(orig, handle)


def patch_transfers(handle) -> None:
    """Wrap ``Tensor.cpu`` (Apex's fp32 transfer rule) for ``handle`` on every device."""
    for name in TENSOR_TRANSFERS_FP32:
        orig = getattr(torch.Tensor, name)
        handle._save_func(torch.Tensor, name, orig)
        setattr(torch.Tensor, name, _fp32_wrapper(orig, handle))
