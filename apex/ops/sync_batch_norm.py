"""Per-channel batch-norm building blocks for ``SyncBatchNorm``: statistics, forward and backward.

Every function takes the input as a contiguous 3-D view ``[N, C, L]`` (channel-first ``[N, C, *]``
flattened to ``L``; channel-last ``[..., C]`` and 2-D ``[N, C]`` as ``[M, C, 1]``), computes in fp32 and
returns fp32 statistics; elementwise outputs have the input's dtype (fp32, fp16 or bf16). With ``xhat =
(x - mean) * invstd``, ``scale = weight * invstd`` and ``shift = bias - mean * scale``:

* forward:  ``y = x * scale + shift (+ z)``, then ``relu`` with ``fuse_relu``;
* backward: ``dy' = dy * (y > 0)`` with ``fuse_relu`` (else ``dy``); the reduction gives
  ``sum_dy = Σ dy'`` and ``sum_dy_xmu = Σ dy' (x - mean)`` per channel (``grad_bias`` and
  ``grad_weight = sum_dy_xmu * invstd`` come from these), and with the group's means ``mean_dy`` and
  ``mean_dy_xmu`` the input gradient is
  ``dx = weight * invstd * (dy' - mean_dy - (x - mean) * invstd² * mean_dy_xmu)``; ``dz = dy'``.

Statistics are one pass over the input with per-channel shifted sums (shift = the channel's first
element), which keeps fp32 accuracy when the mean is large against the spread.
"""

from __future__ import annotations

import torch

from apex import _backend

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def as_ncl(x: torch.Tensor, channel_last: bool) -> torch.Tensor:
    """The contiguous ``[N, C, L]`` view the functions below expect."""
    if x.dim() < 2:
        raise ValueError(f"input must have at least 2 dimensions (N, C, ...), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"input must be float32, float16 or bfloat16, got {x.dtype}")
    x = x.contiguous()
    if channel_last or x.dim() == 2:
        return x.reshape(-1, x.shape[-1], 1)
    return x.reshape(x.shape[0], x.shape[1], -1)


def _weights(C: int, weight, bias, device) -> tuple[torch.Tensor, torch.Tensor]:
    w = weight.float() if weight is not None else torch.ones(C, device=device)
    b = bias.float() if bias is not None else torch.zeros(C, device=device)
    return w, b


def batch_norm_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(mean, biased var)`` in fp32 of ``x`` ``[N, C, L]``."""
    if x.shape[0] * x.shape[2] == 0:
        raise ValueError("batch_norm_stats needs at least one element per channel")
    if _backend.select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        return kernels.stats(x)
    # PyTorch's fused CPU statistics kernel (a fraction of var_mean's time over dims (0, 2)).
    mean, var = torch.batch_norm_update_stats(x.float(), None, None, 0.0)
    return mean.float(), var.float()


def batch_norm_elemt(x, mean, invstd, weight, bias, z=None, fuse_relu: bool = False) -> torch.Tensor:
    """``y = x * scale + shift (+ z)`` (then relu with ``fuse_relu``), in ``x``'s dtype."""
    w, b = _weights(x.shape[1], weight, bias, x.device)
    scale = w * invstd
    shift = b - mean * scale
    if _backend.select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        return kernels.forward(x, scale, shift, z, fuse_relu)
    y = torch.addcmul(shift[:, None], x.float(), scale[:, None])
    if z is not None:
        y += z
    if fuse_relu:
        y.relu_()
    return y.to(x.dtype)


def _dy_act(dy, x, scale, shift, z, fuse_relu):
    dyf = dy.float()
    if not fuse_relu:
        return dyf
    pre = torch.addcmul(shift[:, None], x.float(), scale[:, None])
    if z is not None:
        pre += z
    return dyf * (pre > 0)


def batch_norm_backward_reduce(dy, x, mean, invstd, weight, bias, z=None, fuse_relu: bool = False):
    """Local per-channel ``(sum_dy, sum_dy_xmu)`` in fp32 (``dy`` after the fused relu's mask)."""
    w, b = _weights(x.shape[1], weight, bias, x.device)
    scale = w * invstd
    shift = b - mean * scale
    if _backend.select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        return kernels.backward_reduce(dy, x, mean, scale, shift, z, fuse_relu)
    d = _dy_act(dy, x, scale, shift, z, fuse_relu)
    xf = x.float()
    ones = torch.ones_like(mean)
    # PyTorch's fused CPU kernel in eval mode with unit variance and eps=0 returns exactly
    # (Σ dy (x - mean), Σ dy) as (grad_weight, grad_bias) in one pass over dy and x.
    _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
        d, xf, ones, mean, ones, None, None, False, 0.0, [False, True, True])
    return sum_dy, sum_dy_xmu


def batch_norm_backward_elemt(dy, x, mean, invstd, weight, bias, mean_dy, mean_dy_xmu, z=None,
                              fuse_relu: bool = False, need_dz: bool = False):
    """``(dx, dz)`` in ``x``'s dtype (``dz`` only with ``need_dz``, else None)."""
    w, b = _weights(x.shape[1], weight, bias, x.device)
    scale = w * invstd
    shift = b - mean * scale
    if _backend.select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        return kernels.backward_elemt(dy, x, mean, invstd, scale, shift, mean_dy, mean_dy_xmu, z, fuse_relu,
                                      need_dz)
    d = _dy_act(dy, x, scale, shift, z, fuse_relu)
    k = mean_dy_xmu * invstd * invstd
    # dx = d * scale + x * A + B with per-channel A, B: one fused affine pass over x (batch norm in eval
    # mode with zero mean, unit variance, eps=0) and one addcmul.
    a = -scale * k
    b = scale * (k * mean - mean_dy)
    zeros, ones = torch.zeros_like(mean), torch.ones_like(mean)
    dx = torch.batch_norm(x.float(), a, b, zeros, ones, False, 0.0, 0.0, False)
    dx.addcmul_(d, scale[:, None])
    dz = d.to(x.dtype) if need_dz else None
    return dx.to(x.dtype), dz
