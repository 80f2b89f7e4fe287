"""Apex's ``cudnn_gbn_lib`` (``forward``/``backward`` of the cuDNN group batch norm) with its positional
signatures, over the SyncBatchNorm building blocks (:mod:`apex.ops._syncbn_compat`).

``forward`` normalises ``x`` ``[N, C, H, W]`` with its batch statistics, writes them into
``minibatch_mean`` and ``minibatch_inv_var`` (``1 / sqrt(biased_var + epsilon)``), and updates the running
statistics in place (``running = (1 - momentum) * running + momentum * batch``, unbiased variance).
``backward`` returns ``[dx, dscale, dbias]`` from those saved statistics.

Apex exchanged the statistics of ``bn_group`` ranks through peer-memory buffers (``peer_buffers``, raw
device addresses) inside the kernel. Raw peer addresses have no meaning outside that kernel, so only
``bn_group == 1`` is served here; for groups of ranks use ``apex.contrib.cudnn_gbn.GroupBatchNorm2d``
(statistics exchanged with torch.distributed). Unlike Apex (fp16 channels_last CUDA only), any floating
dtype and memory format work; the output keeps the input's memory format. On the PyTorch path the
statistics, the sums and the elementwise passes run in fp64 and are rounded once (Apex's kernels accumulate
in fp32 within blocks): the results are then accurate and the same on every CPU.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops import _syncbn_compat as sbc

Tensor = torch.Tensor


def _check(x: Tensor, bn_group: int) -> None:
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a 4-D tensor [N, C, H, W], got {getattr(x, 'shape', type(x).__name__)}")
    if bn_group != 1:
        raise NotImplementedError(
            f"cudnn_gbn_lib with bn_group={bn_group}: peer-memory statistics exchange is not available; "
            "use apex.contrib.cudnn_gbn.GroupBatchNorm2d, which exchanges them with torch.distributed")


def _nhwc(t: Tensor) -> Tensor:
    """``[N, H, W, C]`` view (a copy only where the layout needs one): the channel-last functions then see
    channels_last inputs without a copy."""
    return t.permute(0, 2, 3, 1)


def _per_channel(t: Tensor) -> Tensor:
    return t.reshape(1, -1, 1, 1).to(torch.float64)


def forward(x: Tensor, scale: Tensor, bias: Tensor, running_mean: Tensor, running_var: Tensor,
            minibatch_mean: Tensor, minibatch_inv_var: Tensor, momentum: float, epsilon: float, bn_group: int,
            rank_id: int, peer_buffers: list) -> Tensor:
    """``y = (x - mean) * inv_var * scale + bias`` with the batch statistics (see the module docstring)."""
    _check(x, bn_group)
    count = x.numel() // x.shape[1]
    if count < 2:
        raise ValueError(f"expected more than 1 value per channel when training, got input size {list(x.shape)}")
    if _backend.select(x) == "triton":
        xl = _nhwc(x)
        mean, var = sbc.welford_mean_var_c_last(xl)
        inv_std = torch.rsqrt(var + epsilon)
        y = sbc.batchnorm_forward_c_last(xl, None, mean, inv_std, scale, bias, False).permute(0, 3, 1, 2)
    else:
        # PyTorch's channel-last CPU statistics add every row of a channel into one fp32 accumulator (mean
        # off by ~5e-6 at 110K values per channel, which the backward's cancellation turns into ~5e-3 in
        # dscale) in an order set by the CPU's vector width. In fp64 both effects vanish before the fp32
        # rounding, so the results are accurate and the same on every CPU.
        x64 = x.to(torch.float64)
        var, mean = torch.var_mean(x64, dim=(0, 2, 3), unbiased=False)
        inv_std = torch.rsqrt(var + epsilon)
        y = (x64 - _per_channel(mean)) * _per_channel(inv_std * scale.to(torch.float64)) + _per_channel(bias)
    with torch.no_grad():
        minibatch_mean.copy_(mean)
        minibatch_inv_var.copy_(inv_std)
        running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        running_var.mul_(1 - momentum).add_((var * (count / (count - 1))).to(running_var.dtype), alpha=momentum)
    return torch.empty_like(x).copy_(y)


def backward(x: Tensor, dy: Tensor, scale: Tensor, minibatch_mean: Tensor, minibatch_inv_var: Tensor,
             epsilon: float, bn_group: int, rank_id: int, peer_buffers: list) -> list[Tensor]:
    """``[dx, dscale, dbias]`` from the statistics saved by :func:`forward`."""
    _check(x, bn_group)
    if _backend.select(x) == "triton":
        xl, dyl = _nhwc(x), _nhwc(dy)
        sum_dy, sum_dy_xmu, dscale, dbias = sbc.reduce_bn_c_last(dyl, xl, minibatch_mean, minibatch_inv_var, scale)
        count = torch.tensor([x.numel() // x.shape[1]])
        dx = sbc.batchnorm_backward_c_last(dyl, xl, minibatch_mean, minibatch_inv_var, scale, sum_dy, sum_dy_xmu,
                                           count).permute(0, 3, 1, 2)
        return [torch.empty_like(x).copy_(dx), dscale, dbias]
    # In fp64 for the reason given in forward().
    count = x.numel() // x.shape[1]
    dy64 = dy.to(torch.float64)
    xmu = x.to(torch.float64) - _per_channel(minibatch_mean)
    inv_std = _per_channel(minibatch_inv_var)
    sum_dy = dy64.sum((0, 2, 3))
    sum_dy_xmu = (dy64 * xmu).sum((0, 2, 3))
    k = inv_std * inv_std * _per_channel(sum_dy_xmu / count)
    dx = (dy64 - _per_channel(sum_dy / count) - xmu * k) * (inv_std * _per_channel(scale))
    dscale = (sum_dy_xmu * minibatch_inv_var.to(torch.float64)).to(scale.dtype)
    return [torch.empty_like(x).copy_(dx), dscale, sum_dy.to(scale.dtype)]
