"""Apex's ``syncbn`` extension (``csrc/syncbn.cpp``) with its positional signatures, over
:mod:`apex.ops.sync_batch_norm`.

Conventions (as Apex's kernels): channel-first functions take ``[N, C, *]``, the ``*_c_last`` ones
``[..., C]``; statistics and the reduced sums are fp32 for fp16/bf16/fp32 inputs (fp64 stays fp64);
``mean``/``inv_std`` are per-channel; ``count`` is the per-rank element counts (any integer dtype) whose
sum is the group's element count per channel. ``inv_std = 1 / sqrt(biased_var + eps)``;
``welford_parallel`` returns the *unbiased* variance (for the running statistics). Unlike Apex, bf16
inputs are accepted.
"""

from __future__ import annotations

import torch

from apex.ops import sync_batch_norm as sbn

Tensor = torch.Tensor


def _stat_dtype(x: Tensor) -> torch.dtype:
    return sbn.acc_dtype(x)


def _per_channel(t: Tensor | None, x: Tensor) -> Tensor | None:
    return None if t is None else t.reshape(-1).to(_stat_dtype(x))


def welford_mean_var(input: Tensor) -> list[Tensor]:
    """``[mean, biased_var]`` per channel of ``[N, C, *]``."""
    mean, var = sbn.batch_norm_stats(sbn.as_ncl(input, False))
    return [mean, var]


def welford_mean_var_c_last(input: Tensor) -> list[Tensor]:
    """``[mean, biased_var]`` per channel of ``[..., C]``."""
    mean, var = sbn.batch_norm_stats(sbn.as_ncl(input, True))
    return [mean, var]


def welford_parallel(mean_feature_nodes: Tensor, var_biased_feature_nodes: Tensor, numel: Tensor,
                     eps: float) -> list[Tensor]:
    """Merge per-rank ``[world, C]`` means and biased variances of ``numel[i]`` elements each into
    ``[mean, unbiased_var, inv_std]`` (Chan's parallel formula; computed in fp64, returned in the
    variance's dtype)."""
    if mean_feature_nodes.shape != var_biased_feature_nodes.shape or mean_feature_nodes.dim() != 2:
        raise ValueError("mean_feature_nodes and var_biased_feature_nodes must both have shape [world, C], got "
                         f"{list(mean_feature_nodes.shape)} and {list(var_biased_feature_nodes.shape)}")
    if numel.numel() != mean_feature_nodes.shape[0]:
        raise ValueError(f"numel must hold one count per rank ({mean_feature_nodes.shape[0]}), got {numel.numel()}")
    out = var_biased_feature_nodes.dtype
    n = numel.reshape(-1, 1).to(torch.float64)
    total = n.sum()
    m = mean_feature_nodes.to(torch.float64)
    mean = (m * n).sum(0) / total
    m2n = (var_biased_feature_nodes.to(torch.float64) * n + (m - mean) ** 2 * n).sum(0)
    var = m2n / (total - 1)
    inv_std = torch.rsqrt(m2n / total + eps)
    return [mean.to(out), var.to(out), inv_std.to(out)]


def batchnorm_forward(input: Tensor, mean: Tensor, inv_std: Tensor, weight: Tensor | None,
                      shift: Tensor | None) -> Tensor:
    """``(x - mean) * inv_std * weight + shift`` on ``[N, C, *]``, in the input's dtype."""
    x = sbn.as_ncl(input, False)
    y = sbn.batch_norm_elemt(x, _per_channel(mean, x), _per_channel(inv_std, x), weight, shift)
    return y.view(input.shape)


def batchnorm_forward_c_last(input: Tensor, z: Tensor | None, mean: Tensor, inv_std: Tensor,
                             weight: Tensor | None, shift: Tensor | None, fuse_relu: bool) -> Tensor:
    """``relu?((x - mean) * inv_std * weight + shift + z)`` on ``[..., C]``."""
    x = sbn.as_ncl(input, True)
    zz = None if z is None else sbn.as_ncl(z, True)
    y = sbn.batch_norm_elemt(x, _per_channel(mean, x), _per_channel(inv_std, x), weight, shift, zz,
                             bool(fuse_relu))
    return y.view(input.shape)


def _reduce(grad_output: Tensor, input: Tensor, mean: Tensor, inv_std: Tensor, weight: Tensor | None,
            channel_last: bool) -> list[Tensor]:
    x = sbn.as_ncl(input, channel_last)
    dy = sbn.as_ncl(grad_output, channel_last)
    m, s = _per_channel(mean, x), _per_channel(inv_std, x)
    sum_dy, sum_dy_xmu = sbn.batch_norm_backward_reduce(dy, x, m, s, weight, None)
    if weight is None:
        empty = sum_dy.new_empty((0,))
        return [sum_dy, sum_dy_xmu, empty, empty.clone()]
    return [sum_dy, sum_dy_xmu, (sum_dy_xmu * s).to(weight.dtype), sum_dy.to(weight.dtype)]


def reduce_bn(grad_output: Tensor, input: Tensor, mean: Tensor, inv_std: Tensor,
              weight: Tensor | None) -> list[Tensor]:
    """``[sum_dy, sum_dy_xmu, grad_weight, grad_bias]`` (local sums; the gradients are empty without
    ``weight``) on ``[N, C, *]``."""
    return _reduce(grad_output, input, mean, inv_std, weight, False)


def reduce_bn_c_last(grad_output: Tensor, input: Tensor, mean: Tensor, inv_std: Tensor,
                     weight: Tensor | None) -> list[Tensor]:
    """As :func:`reduce_bn`, on ``[..., C]``."""
    return _reduce(grad_output, input, mean, inv_std, weight, True)


def _backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count, channel_last):
    x = sbn.as_ncl(input, channel_last)
    dy = sbn.as_ncl(grad_output, channel_last)
    total = count.to(torch.float64).sum().item()
    if total <= 0:
        raise ValueError(f"count must sum to a positive number of elements, got {total}")
    acc = _stat_dtype(x)
    mean_dy = sum_dy.to(acc) / total
    mean_dy_xmu = sum_dy_xmu.to(acc) / total
    dx, _ = sbn.batch_norm_backward_elemt(dy, x, _per_channel(mean, x), _per_channel(inv_std, x), weight, None,
                                          mean_dy, mean_dy_xmu)
    return dx.view(input.shape)


def batchnorm_backward(grad_output: Tensor, input: Tensor, mean: Tensor, inv_std: Tensor, weight: Tensor | None,
                       sum_dy: Tensor, sum_dy_xmu: Tensor, count: Tensor) -> Tensor:
    """``grad_input = weight * inv_std * (dy - sum_dy/M - (x - mean) * inv_std² * sum_dy_xmu/M)`` with
    ``M = count.sum()``, on ``[N, C, *]``."""
    return _backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count, False)


def batchnorm_backward_c_last(grad_output: Tensor, input: Tensor, mean: Tensor, inv_std: Tensor,
                              weight: Tensor | None, sum_dy: Tensor, sum_dy_xmu: Tensor, count: Tensor) -> Tensor:
    """As :func:`batchnorm_backward`, on ``[..., C]``."""
    return _backward(grad_output, input, mean, inv_std, weight, sum_dy, sum_dy_xmu, count, True)


def relu_bw_c_last(grad_output: Tensor, input: Tensor, z: Tensor | None, mean: Tensor, inv_std: Tensor,
                   weight: Tensor | None, shift: Tensor | None) -> Tensor:
    """``grad_output`` where the fused forward's pre-relu value is positive, else 0 (``[..., C]``)."""
    x = sbn.as_ncl(input, True)
    dy = sbn.as_ncl(grad_output, True)
    zz = None if z is None else sbn.as_ncl(z, True)
    g = sbn.relu_grad(dy, x, _per_channel(mean, x), _per_channel(inv_std, x), weight, shift, zz)
    return g.to(grad_output.dtype).view(grad_output.shape)
