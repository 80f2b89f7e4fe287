"""``BatchNorm2d_NHWC``: Apex's NHWC batch norm (optionally + residual + ReLU) with statistics over a group of
``bn_group`` consecutive ranks, on ``apex.parallel.SyncBatchNorm``.

Inputs are explicit NHWC tensors ``(N, H, W, C)``. ``forward(x, z=None)`` returns
``relu?(batch_norm(x) + z)`` (``z`` requires ``fuse_relu=True``, as in Apex). Statistics in fp32, output in
the input dtype. ``max_cta_per_sm``, ``cta_launch_margin`` and ``multi_stream`` tuned Apex's CUDA kernels and
are accepted for compatibility. Apex exchanged statistics between GPUs through CUDA IPC; here it is one
``torch.distributed`` all-gather (any backend).
"""

from __future__ import annotations

import torch

from apex._errors import AssertValueError
from apex.contrib._group import consecutive_group
from apex.parallel.sync_batchnorm import SyncBatchNorm


class BatchNorm2d_NHWC(SyncBatchNorm):  # noqa: N801 - Apex's name
    def __init__(self, num_features, fuse_relu=False, bn_group=1, max_cta_per_sm=2, cta_launch_margin=12,
                 multi_stream=False):
        group = consecutive_group(bn_group, "BatchNorm2d_NHWC")
        super().__init__(num_features, process_group=group, channel_last=True, fuse_relu=fuse_relu)
        self.bn_group = bn_group
        self.max_cta_per_sm = max_cta_per_sm
        self.cta_launch_margin = cta_launch_margin
        self.multi_stream = multi_stream

    def forward(self, x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 4:
            raise ValueError(f"BatchNorm2d_NHWC expects an (N, H, W, C) input, got shape {tuple(x.shape)}")
        if z is not None and not self.fuse_relu:
            raise AssertValueError("BatchNorm2d_NHWC adds z only with fuse_relu=True")
        return super().forward(x, z)


# ---------------------------------------------------------------------------------- compat: bnp.*
# Apex's bnp exposed its CUDA kernels' launch tuning and IPC buffers; only the occupancy queries have a
# meaning without them (one resident program per SM).
def bn_fwd_nhwc_occupancy() -> int:
    """Upstream's CUDA occupancy query for the NHWC batch-norm forward; always 1 (no persistent kernels here)."""
    return 1


def bn_bwd_nhwc_occupancy() -> int:
    """Upstream's CUDA occupancy query for the NHWC batch-norm backward; always 1."""
    return 1


def bn_addrelu_fwd_nhwc_occupancy() -> int:
    """Upstream's CUDA occupancy query for the fused add-ReLU batch-norm forward; always 1."""
    return 1


def bn_addrelu_bwd_nhwc_occupancy() -> int:
    """Upstream's CUDA occupancy query for the fused add-ReLU batch-norm backward; always 1."""
    return 1
