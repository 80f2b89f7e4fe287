"""``torch.ops.cudnn.layer_norm(x, normalized_shape, weight, bias, eps)`` -> ``(y, mean, invstd)``, and
``torch.ops.cudnn.layer_norm_backward``, with Apex's names and signatures.

Apex ran these through cuDNN-frontend graphs on CUDA only. Here both are PyTorch's own
``native_layer_norm``/``native_layer_norm_backward`` on any device: ``y = (x - mean) * invstd * weight +
bias`` over the trailing ``normalized_shape`` dims, ``mean``/``invstd`` fp32 of shape ``[M, 1, 1, 1]``
(``M`` = the leading elements, Apex's shape). ``y`` has the input's dtype; fp16/bf16 are computed in
fp32. Differentiable (autograd registered), traceable by ``torch.compile`` (fake implementations registered).
"""

from __future__ import annotations

import math

import torch

__all__ = ["layer_norm", "layer_norm_backward"]


def _check(x: torch.Tensor, normalized_shape: list[int]) -> tuple[int, int]:
    k = len(normalized_shape)
    if k == 0 or tuple(x.shape[x.dim() - k:]) != tuple(normalized_shape):
        raise ValueError(f"layer_norm expects x.shape[-{k}:] == normalized_shape, got x.shape={tuple(x.shape)}, "
                         f"normalized_shape={tuple(normalized_shape)}")
    return math.prod(x.shape[:x.dim() - k]), math.prod(normalized_shape)


def _acc(x: torch.Tensor) -> torch.dtype:
    """Computation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _stat_shape(m: int) -> tuple[int, int, int, int]:
    return (m, 1, 1, 1)


@torch.library.custom_op("cudnn::layer_norm", mutates_args=())
def layer_norm(x: torch.Tensor, normalized_shape: list[int], weight: torch.Tensor, bias: torch.Tensor,
               eps: float = 1e-05) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, _ = _check(x, normalized_shape)
    # fp16/bf16 go through fp32 (PyTorch's CPU kernel would round the statistics to the input dtype).
    acc = _acc(x)
    y, mean, rstd = torch.ops.aten.native_layer_norm(x.to(acc), list(normalized_shape), weight.to(acc),
                                                     bias.to(acc), eps)
    return y.to(x.dtype), mean.float().reshape(_stat_shape(m)), rstd.float().reshape(_stat_shape(m))


@layer_norm.register_fake
def _(x, normalized_shape, weight, bias, eps=1e-05):
    m, _ = _check(x, normalized_shape)
    stat = x.new_empty(_stat_shape(m), dtype=torch.float32)
    return torch.empty_like(x), stat, stat.clone()


@torch.library.custom_op("cudnn::layer_norm_backward", mutates_args=())
def layer_norm_backward(d_y: torch.Tensor, x_mean: torch.Tensor, x_invstd: torch.Tensor, x: torch.Tensor,
                        normalized_shape: list[int], weight: torch.Tensor, bias: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, _ = _check(x, normalized_shape)
    lead = x.shape[:x.dim() - len(normalized_shape)] + (1,) * len(normalized_shape)
    acc = _acc(x)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        d_y.to(acc).contiguous(), x.to(acc), list(normalized_shape), x_mean.to(acc).reshape(lead),
        x_invstd.to(acc).reshape(lead), weight.to(acc), bias.to(acc), [True, True, True])
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(bias.dtype)


@layer_norm_backward.register_fake
def _(d_y, x_mean, x_invstd, x, normalized_shape, weight, bias):
    return torch.empty_like(x), torch.empty_like(weight), torch.empty_like(bias)


def _setup_context(ctx, inputs, output) -> None:
    x, normalized_shape, weight, bias, _ = inputs
    _, mean, invstd = output
    ctx.save_for_backward(x, weight, bias, mean, invstd)
    ctx.normalized_shape = normalized_shape


def _backward(ctx, d_y, d_mean, d_invstd):
    x, weight, bias, mean, invstd = ctx.saved_tensors
    d_x, d_w, d_b = torch.ops.cudnn.layer_norm_backward(d_y, mean, invstd, x, ctx.normalized_shape, weight, bias)
    return d_x, None, d_w, d_b, None


layer_norm.register_autograd(_backward, setup_context=_setup_context)
