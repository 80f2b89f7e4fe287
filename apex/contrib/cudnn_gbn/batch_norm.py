"""``GroupBatchNorm2d``: batch norm whose training statistics cover ``group_size`` consecutive ranks, on
``apex.parallel.SyncBatchNorm`` (one ``torch.distributed`` all-gather of per-rank statistics forward, one
all-reduce backward; Apex used cuDNN with peer-memory buffers).

Input (N, C, H, W) with C a multiple of 8 (Apex's constraint). Unlike Apex, any floating dtype and memory
format are accepted (Apex required fp16 channels_last CUDA tensors); under autocast the input is cast to the
autocast dtype of its device, as Apex did. Eval mode uses the running statistics (``F.batch_norm``).

Weight and bias gradients are Apex's: the group's gradient (summed over every rank's samples) divided by
``group_size``, the same on every rank of the group, so a data-parallel average over the group afterwards
leaves them unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex.contrib._group import consecutive_group
from apex.parallel.sync_batchnorm import SyncBatchNorm


class GroupBatchNorm2d(SyncBatchNorm):
    def __init__(self, num_features, group_size, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        group = consecutive_group(group_size, "GroupBatchNorm2d")
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats, process_group=group)
        self.group_size = group_size
        if affine and group_size > 1:
            self.weight.register_hook(self._group_mean_grad)
            self.bias.register_hook(self._group_mean_grad)

    def _group_mean_grad(self, grad: torch.Tensor) -> torch.Tensor:
        # Training-mode gradients only: eval mode normalises with the running statistics, rank by rank.
        if not self.training or not dist.is_initialized():
            return grad
        grad = grad.clone()
        dist.all_reduce(grad, group=self.process_group)
        return grad.div_(self.group_size)

    def _check_input_dim(self, input):
        if input.dim() != 4:
            raise ValueError(f"expected 4D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.size(1) % 8 != 0:
            raise ValueError("GroupBatchNorm2d number of input channels should be a multiple of 8")
        if torch.is_autocast_enabled(input.device.type):
            input = input.to(torch.get_autocast_dtype(input.device.type))
        return super().forward(input)
