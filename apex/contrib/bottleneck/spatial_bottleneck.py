"""Apex's ``SpatialBottleneck``: the ``Bottleneck`` block with its input split along H across the ranks of a
spatial group, each rank holding consecutive rows (rank 0 the top ones).

Only the 3×3 convolution looks across rows: before it, each rank gets the row above its slice of ``out1``
from its left neighbour and the row below from its right neighbour through the ``spatial_halo_exchanger``
(zeros at the group's edges, i.e. the convolution's own zero padding), then runs the convolution without H
padding. The backward sends the gradients of those two halo rows back to the neighbours that own them, so
every rank's input gradient is exactly its slice of the one-process gradient, and parameter gradients are this
rank's share: summed over the group (``all_reduce``) they equal the one-process ones. Outputs are the rows of
the one-process output that this rank's input rows produce. Same dtype policy as ``Bottleneck`` (the input's
dtype throughout).

``spatial_parallel_args = (spatial_group_size, spatial_group_rank, spatial_communicator,
spatial_halo_exchanger, spatial_method, use_delay_kernel)`` as in Apex. Apex's ``spatial_method`` 1, 2 and 3
chose how its cuDNN kernels overlapped the exchange with the convolution; all compute the same function and
are accepted. ``spatial_communicator`` and ``use_delay_kernel`` are accepted and unused. Unlike Apex, the
spatial path also runs with ``use_cudnn=False``.
"""

from __future__ import annotations

import torch

from apex._errors import AssertValueError
from apex.contrib.bottleneck.bottleneck import Bottleneck


class _HaloPad(torch.autograd.Function):
    """``x`` (N, C, H, W) padded to H + 2 rows with the neighbours' edge rows; backward returns the halo rows'
    gradients to their owners."""

    @staticmethod
    def forward(ctx, x, exchanger):
        ctx.exchanger = exchanger
        n = x.shape[2]
        padded = torch.empty((x.shape[0], x.shape[1], n + 2, x.shape[3]), dtype=x.dtype, device=x.device,
                             memory_format=_format_of(x))
        padded[:, :, 1:n + 1].copy_(x)
        exchanger.left_right_halo_exchange(x[:, :, :1], x[:, :, n - 1:], padded[:, :, :1], padded[:, :, n + 1:])
        return padded

    @staticmethod
    def backward(ctx, grad):
        n = grad.shape[2] - 2
        grad_x = grad[:, :, 1:n + 1].clone(memory_format=_format_of(grad))
        # my top halo row is my left neighbour's last row: its gradient goes back to the left neighbour, which
        # receives it as its right input halo; the right neighbour's top-halo gradient is my last row's share
        from_left, from_right = ctx.exchanger.left_right_halo_exchange(
            grad[:, :, :1].contiguous(), grad[:, :, n + 1:].contiguous())
        grad_x[:, :, :1] += from_left
        grad_x[:, :, n - 1:] += from_right
        return grad_x, None


def _format_of(x: torch.Tensor) -> torch.memory_format:
    return torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous() \
        else torch.contiguous_format


def _check_spatial_args(args) -> tuple:
    if args is None:
        return (1, 0, None, None, 0, False)
    if not isinstance(args, (tuple, list)) or len(args) != 6:
        raise ValueError("spatial_parallel_args must be (spatial_group_size, spatial_group_rank, spatial_communicator, "
                         f"spatial_halo_exchanger, spatial_method, use_delay_kernel), got {args!r}")
    size, rank, _comm, exchanger, method, _delay = args
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"spatial_group_size must be a positive int, got {size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"spatial_group_rank must be in [0, {size}), got {rank!r}")
    if size > 1:
        if not callable(getattr(exchanger, "left_right_halo_exchange", None)):
            raise TypeError("spatial_halo_exchanger must have left_right_halo_exchange (e.g. HaloExchangerSendRecv), "
                            f"got {type(exchanger).__name__}")
        if method not in (1, 2, 3):  # Apex asserts this in forward
            raise AssertValueError(f"spatial_method must be 1, 2 or 3, got {method!r}")
    return tuple(args)


class SpatialBottleneck(Bottleneck):
    """``Bottleneck`` over an H-split input (see the module docstring); Apex's constructor arguments."""

    def __init__(self, in_channels, bottleneck_channels, out_channels, stride=1, groups=1, dilation=1,
                 norm_func=None, use_cudnn=False, explicit_nhwc=False, spatial_parallel_args=None):
        spatial_parallel_args = _check_spatial_args(spatial_parallel_args)
        super().__init__(in_channels, bottleneck_channels, out_channels, stride, groups, dilation, norm_func,
                         use_cudnn, explicit_nhwc)
        self.spatial_parallel_args = spatial_parallel_args

    def forward(self, x):
        size, _, _, exchanger, _, _ = self.spatial_parallel_args
        if size == 1:
            return super().forward(x)
        if x.dim() != 4:
            layout = "(N, H, W, C)" if self.explicit_nhwc else "(N, C, H, W)"
            raise ValueError(f"SpatialBottleneck expects a 4-d {layout} input, got shape {tuple(x.shape)}")
        if self.explicit_nhwc:
            x = x.permute(0, 3, 1, 2)  # a channels_last NCHW view
        if x.shape[2] % self.stride:
            # a strided 1x1 conv keeps global rows 0, s, 2s, ...: every slice must start on one of them
            raise ValueError(f"SpatialBottleneck: each rank's H slice ({x.shape[2]} rows) must be a multiple of "
                             f"the stride {self.stride}")
        out = self.relu(self.bn1(self._conv(self.conv1, x, self.stride)))
        out = _HaloPad.apply(out, exchanger)
        out = self.relu(self.bn2(self._conv(self.conv2, out, 1, (0, 1))))
        out = self.bn3(self._conv(self.conv3, out))
        identity = x
        if self.downsample is not None:
            identity = self.downsample[1](self._conv(self.downsample[0], x, self.stride))
        out = self.relu(out + identity)
        return out.permute(0, 2, 3, 1) if self.explicit_nhwc else out
