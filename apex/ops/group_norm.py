"""GroupNorm with an optional fused SiLU: ``y = act((x − mean_g) / sqrt(var_g + eps) · weight_c + bias_c)``.

Statistics are per (sample, group) over the group's ``C/G`` channels and all spatial positions (biased
variance). ``act`` is ``""``/None (none) or ``"silu"``/``"swish"``. Inputs are ``[N, C, *spatial]`` in NCHW
(contiguous) or NHWC (``channels_last`` / ``channels_last_3d``) layout; the output keeps the input's layout.

Dtype policy: arithmetic and the saved ``mean``/``rstd`` in fp32 (fp64 for fp64 inputs, on PyTorch); the
output and ``dx`` in the input dtype; parameter gradients in the parameters' dtype, which may differ from the
input's (fp32 weights with fp16/bf16 activations, as Apex's NHWC kernels allow).

Paths: CUDA/ROCm tensors run ``apex._kernels.group_norm`` behind the ``apex::group_norm_fwd`` /
``apex::group_norm_bwd`` custom ops (one launch forward and one backward, plus a parameter-gradient row sum,
when a group fits one tile; two launches each otherwise); CPU tensors run ``F.group_norm`` (PyTorch's
fused kernel, which handles channels_last) and ``F.silu``, in fp32 for fp16/bf16 inputs; groups of 2^16
elements or more take ``var_mean`` statistics and a centred backward instead (see ``ACCURATE_MIN_GROUP``).
Eager Triton calls on plain tensors launch those kernels from a plan per argument layout, past the checks and
the custom ops (``apex.ops._group_norm_direct``; the same launches and bits).
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from apex._errors import AssertValueError, RuntimeValueError
from apex.ops._dispatch import custom_op, lazy_module
from apex.ops._group_norm_direct import Lean
from apex.ops._norm import _same_device, select

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.group_norm")
ACTIVATIONS = (None, "", "silu", "swish")


def check_args(input: object, num_groups: object, weight: object, bias: object, act: object) -> bool:
    """Validate a call; return whether the SiLU is applied."""
    # Shapes that do not fit are also the RuntimeError of Apex's group_norm_cuda (groups and channels) and of
    # PyTorch's group_norm, which Apex's GroupNorm runs on inputs its kernels do not take; act is also the
    # AssertionError of Apex's functional forms.
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"input must be a floating-point tensor, got {input.dtype}")
    if input.dim() < 2:
        raise RuntimeValueError(f"input must have shape [N, C, *spatial], got {list(input.shape)}")
    # (an int is the common case: the ABC check for numpy and other integers only otherwise)
    if type(num_groups) is not int and (isinstance(num_groups, bool)
                                        or not isinstance(num_groups, numbers.Integral)):
        raise RuntimeValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if num_groups <= 0:
        raise RuntimeValueError(f"num_groups must be a positive int, got {num_groups!r}")
    c = input.shape[1]
    if c % num_groups:
        raise RuntimeValueError(f"num_groups={num_groups} must divide the number of channels C={c}")
    if (weight is None) != (bias is None):
        raise ValueError("weight and bias must both be given or both be None")
    if weight is not None:
        dev = input.device  # read once
        for name, p in (("weight", weight), ("bias", bias)):
            if not isinstance(p, torch.Tensor) or not p.is_floating_point():
                raise TypeError(f"{name} must be a floating-point torch.Tensor or None")
            if p.dim() != 1 or p.shape[0] != c:
                raise RuntimeValueError(f"{name} must have shape [{c}] (the channels), got {list(p.shape)}")
            if p.device != dev:
                raise RuntimeValueError(f"{name} is on {p.device} but input is on {dev}")
    if act is None or (type(act) is str and not act):  # the default: no activation
        return False
    a = act.lower() if isinstance(act, str) else act
    if a not in ACTIVATIONS:
        raise AssertValueError(f"act must be one of '', 'silu', 'swish' or None, got {act!r}")
    return a in ("silu", "swish")


_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _layout(x: Tensor) -> Tensor:
    """``x`` itself if its spatial dims flatten with one stride in NCHW or NHWC order, else a copy."""
    if x.is_contiguous():
        return x
    fmt = _CHANNELS_LAST.get(x.dim())
    if fmt is not None and x.is_contiguous(memory_format=fmt):
        return x
    return x.contiguous()


def _use_kernel(x: Tensor, num_groups: int) -> bool:
    if x.dtype == torch.float64 or select(x) != "triton":
        return False
    return _kernels().supported(x.shape[1] // num_groups)


# ------------------------------------------------------------------------------------------- torch
def _group_norm_torch(x, num_groups, weight, bias, eps, silu):
    # fp16/bf16 or mixed dtypes: compute in fp32 and round the output once. PyTorch's CPU kernels in bf16
    # lose ~1e-2 in the parameter gradients, and its mixed-type kernel ~1e-4 in fp32 ones.
    ct = torch.promote_types(torch.float32, x.dtype)
    if weight is not None:
        ct = torch.promote_types(ct, weight.dtype)
    if ct == x.dtype and (weight is None or weight.dtype == ct):
        y = F.group_norm(x, num_groups, weight, bias, eps)
        return F.silu(y) if silu else y
    cast = (lambda p: p.to(ct) if p is not None else None)
    y = F.group_norm(x.to(ct), num_groups, cast(weight), cast(bias), eps)
    return (F.silu(y) if silu else y).to(x.dtype)


# PyTorch's CPU GroupNorm loses accuracy on large groups whose mean is far from zero (its fp32 statistics
# and its uncentred backward sums cancel: 5e-3 relative in dweight for 32×128×256×256 fp16 inputs with mean
# −2.3, as in Apex's own test). From this many elements per group the PyTorch path computes the statistics
# with ``var_mean`` and the backward from centred values instead.
ACCURATE_MIN_GROUP = 1 << 16


def _forward_torch(x, num_groups, weight, bias, eps, silu):
    """``(y, mean, rstd)`` with fp32 (fp64) two-pass statistics; y keeps x's memory format."""
    n, c = x.shape[:2]
    if (x.dtype in (torch.float32, torch.float64) and x.is_contiguous()
            and all(t is None or t.dtype == x.dtype for t in (weight, bias))):
        # PyTorch's own fused kernel, 3-4x the speed of the composition below. Only for contiguous (NCHW)
        # inputs: its channels_last CPU kernel loses up to 1e-4 relative accuracy on groups with a large mean
        # (one-pass variance), so NHWC and half inputs take the two-pass composition (fp32 statistics).
        y, mean, rstd = torch.native_group_norm(x, weight, bias, n, c, x[0, 0].numel(), num_groups, eps)
        return (F.silu(y, inplace=True) if silu else y), mean.reshape(-1), rstd.reshape(-1)
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    cg = c // num_groups
    # (N, positions, C): a view of a channels_last tensor, so both passes reduce over the outer dim with the
    # channels contiguous (PyTorch's var_mean over that dim is 2x slower than both sums together).
    xv = x.permute(0, *range(2, x.dim()), 1).reshape(n, -1, c)
    count = xv.shape[1] * cg
    mean = xv.sum(1, dtype=ct).view(n, num_groups, cg).sum(-1) / count
    d = xv.to(ct) - mean.repeat_interleave(cg, 1)[:, None, :]  # second pass: exact two-pass variance
    var = d.square_().sum(1).view(n, num_groups, cg).sum(-1) / count
    del d
    rstd = (var + eps).rsqrt()
    shape = (n, c) + (1,) * (x.dim() - 2)
    scale = rstd.repeat_interleave(cg, 1)
    shift = -mean.repeat_interleave(cg, 1) * scale
    if weight is not None:
        scale = scale * weight.to(ct)
        shift = shift * weight.to(ct) + bias.to(ct)
    y = torch.addcmul(shift.reshape(shape), x, scale.reshape(shape))  # a half x promotes: one rounding below
    if silu:
        F.silu(y, inplace=True)
    return y.to(x.dtype), mean.reshape(-1), rstd.reshape(-1)


class _AccurateGroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps, silu):
        y, mean, rstd = _forward_torch(x, num_groups, weight, bias, eps, silu)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.num_groups, ctx.silu = num_groups, silu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward_torch(dy, x, mean, rstd, ctx.num_groups, weight, bias, ctx.silu)
        return dx, None, dw, db, None, None


# --------------------------------------------------------------------------------- dispatch (no autograd)
def group_norm_forward(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
                       eps: float = 1e-5, act: str | None = "") -> tuple[Tensor, Tensor, Tensor]:
    """``(output, mean, rstd)`` without autograd; ``mean``/``rstd`` have ``N·G`` fp32 entries."""
    silu = check_args(input, num_groups, weight, bias, act)
    return _forward_checked(input, num_groups, weight, bias, eps, silu)


def _forward_checked(input, num_groups, weight, bias, eps, silu):
    """:func:`group_norm_forward` on arguments :func:`check_args` passed."""
    x = _layout(input)
    if _use_kernel(x, num_groups):
        return _kernels().forward(x, num_groups, weight, bias, float(eps), silu)
    return _forward_torch(x, num_groups, weight, bias, float(eps), silu)


def group_norm_backward(grad_output: Tensor, input: Tensor, mean: Tensor, rstd: Tensor, num_groups: int,
                        weight: Tensor | None = None, bias: Tensor | None = None, act: str | None = ""
                        ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(grad_input, grad_weight, grad_bias)`` from the saved statistics."""
    silu = check_args(input, num_groups, weight, bias, act)
    if not isinstance(grad_output, torch.Tensor) or tuple(grad_output.shape) != tuple(input.shape):
        got = list(grad_output.shape) if isinstance(grad_output, torch.Tensor) else type(grad_output).__name__
        raise ValueError(f"grad_output must have the input's shape {list(input.shape)}, got {got}")
    ng = input.shape[0] * num_groups
    for name, t in (("mean", mean), ("rstd", rstd)):
        if not isinstance(t, torch.Tensor) or t.numel() != ng:
            raise ValueError(f"{name} must hold N·G = {ng} values")
    # The kernels read these next to the input: a pointer of another device is an illegal access there.
    for name, t in (("grad_output", grad_output), ("mean", mean), ("rstd", rstd)):
        if not _same_device(t, input):
            raise RuntimeValueError(f"{name} is on {t.device} but input is on {input.device}")
    return _backward_checked(grad_output, input, mean, rstd, num_groups, weight, bias, silu)


def _stat(t: Tensor) -> Tensor:
    # The forward's own statistics are already 1-D contiguous fp32: no reshape or copy (~2 µs each).
    if t.dim() == 1 and t.dtype == torch.float32 and t.is_contiguous():
        return t
    return t.reshape(-1).float().contiguous()


def _backward_checked(grad_output, input, mean, rstd, num_groups, weight, bias, silu):
    """:func:`group_norm_backward` on arguments it checked (or the autograd forward's saved ones)."""
    x = _layout(input)
    if _use_kernel(x, num_groups):
        return _backward_kernels(grad_output, x, _stat(mean), _stat(rstd), num_groups, weight, bias, silu)
    return _backward_torch(grad_output, x, mean, rstd, num_groups, weight, bias, silu)


def _backward_kernels(grad_output, x, mean, rstd, num_groups, weight, bias, silu):
    """The Triton backward on a laid-out ``x`` and the forward's fp32 statistics (the parameter gradients come
    in the parameters' dtype)."""
    dy = grad_output if grad_output.stride() == x.stride() else torch.empty_like(x).copy_(grad_output)
    return _kernels().backward(dy, x, num_groups, weight, bias, mean, rstd, silu)


def _backward_torch(dy, x, mean, rstd, num_groups, weight, bias, silu):
    n, c = x.shape[:2]
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    shape = (n, num_groups, c // num_groups, -1)
    xh = (x.to(ct).reshape(shape) - mean.to(ct).reshape(n, num_groups, 1, 1)) * rstd.to(ct).reshape(
        n, num_groups, 1, 1)
    w = weight.to(ct).reshape(1, num_groups, -1, 1) if weight is not None else None
    dz = dy.to(ct).reshape(shape)
    if silu:
        z = xh * w + bias.to(ct).reshape(1, num_groups, -1, 1) if w is not None else xh
        sg = torch.sigmoid(z)
        dz = dz * sg * (1 + z * (1 - sg))
    dxh = dz * w if w is not None else dz
    m1 = dxh.mean((2, 3), keepdim=True)
    m2 = (dxh * xh).mean((2, 3), keepdim=True)
    dx = ((dxh - m1 - xh * m2) * rstd.to(ct).reshape(n, num_groups, 1, 1)).reshape(x.shape).to(x.dtype)
    if weight is None:
        return dx, None, None
    dw = (dz * xh).sum((0, 3)).reshape(c).to(weight.dtype)
    db = dz.sum((0, 3)).reshape(c).to(bias.dtype)
    return dx, dw, db


# ------------------------------------------------------------------------------------------ custom ops
@custom_op("apex::group_norm_fwd", materialize_grads=False, grad_outputs=1)
def _fwd_op(input: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None, eps: float, act: str
            ) -> tuple[Tensor, Tensor, Tensor]:
    # Called by group_norm with checked arguments (act normalised to "silu" or ""): no second check.
    y, mean, rstd = _forward_checked(input, num_groups, weight, bias, eps, act == "silu")
    return y, mean, rstd


@_fwd_op.register_fake
def _(input, num_groups, weight, bias, eps, act):
    ng = input.shape[0] * num_groups
    return torch.empty_like(input), input.new_empty((ng,), dtype=torch.float32), \
        input.new_empty((ng,), dtype=torch.float32)


@custom_op("apex::group_norm_bwd")
def _bwd_op(grad_output: Tensor, input: Tensor, mean: Tensor, rstd: Tensor, num_groups: int,
            weight: Tensor | None, bias: Tensor | None, act: str) -> tuple[Tensor, Tensor, Tensor]:
    # Called by the autograd backward with the forward's checked tensors; autograd checked grad_output's shape.
    dx, dw, db = _backward_checked(grad_output, input, mean, rstd, num_groups, weight, bias, act == "silu")
    if dw is None:  # (two distinct empty tensors: a custom op's outputs may not alias)
        dw, db = input.new_empty((0,)), input.new_empty((0,))
    return dx, dw, db


@_bwd_op.register_fake
def _(grad_output, input, mean, rstd, num_groups, weight, bias, act):
    return (torch.empty_like(input), torch.empty_like(weight) if weight is not None else input.new_empty((0,)),
            torch.empty_like(bias) if bias is not None else input.new_empty((0,)))


def _setup(ctx, inputs, output):
    input, num_groups, weight, bias, eps, act = inputs
    _, mean, rstd = output
    ctx.num_groups, ctx.act = num_groups, act
    ctx.save_for_backward(input, weight, bias, mean, rstd)


def _backward(ctx, grad_y, grad_mean, grad_rstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    if grad_y is None:  # the eager path's None (materialize_grads=False): only the statistics were used
        grad_y = torch.zeros_like(x)
    dx, dw, db = _bwd_op(grad_y, x, mean, rstd, ctx.num_groups, weight, bias, ctx.act)
    return dx, None, dw if weight is not None else None, db if bias is not None else None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------------------------- autograd entry
# A planned eager Triton call (apex.ops._group_norm_direct): its checks passed for the same facts.
_lean = Lean(_kernels, check_args, _layout, (_bwd_op, _backward_checked)).run


def group_norm(input: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, act: str | None = "") -> Tensor:
    """Differentiable GroupNorm (+ SiLU with ``act="silu"``); see the module docstring."""
    out = _lean(input, num_groups, weight, bias, eps, act)
    if out is not None:
        return out
    silu = check_args(input, num_groups, weight, bias, act)
    num_groups = int(num_groups)
    if _use_kernel(input, num_groups):  # (compiling, a dispatch mode, a subclass, a call not planned)
        return _fwd_op(input, num_groups, weight, bias, float(eps), "silu" if silu else "")[0]
    if input.numel() // max(input.shape[0] * num_groups, 1) >= ACCURATE_MIN_GROUP:
        return _AccurateGroupNorm.apply(input, num_groups, weight, bias, float(eps), silu)
    return _group_norm_torch(input, num_groups, weight, bias, float(eps), silu)


# ---------------------------------------------------------------------- Apex's ``group_norm_cuda`` entry points
def forward(input: Tensor, groups: int, weight: Tensor, bias: Tensor, eps: float, passes: int = 1,
            with_swish: bool = False) -> list[Tensor]:
    """``group_norm_cuda.forward``: ``[y, sums]``; ``sums`` holds (mean, rstd) pairs per (n, group), fp32.
    ``passes`` is accepted and ignored (the kernels choose their own split)."""
    y, mean, rstd = group_norm_forward(input, groups, weight, bias, eps, "silu" if with_swish else "")
    return [y, torch.stack([mean.float(), rstd.float()], -1).reshape(-1)]


def backward(grad_output: Tensor, sums: Tensor, input: Tensor, groups: int, weight: Tensor, bias: Tensor,
             eps: float, passes: int = 1, with_swish: bool = False) -> list[Tensor]:
    """``group_norm_cuda.backward``: ``[dx, dweight, dbias]`` from the ``sums`` of :func:`forward`."""
    pairs = sums.reshape(-1, 2)
    return list(group_norm_backward(grad_output, input, pairs[:, 0], pairs[:, 1], groups, weight, bias,
                                    "silu" if with_swish else ""))
