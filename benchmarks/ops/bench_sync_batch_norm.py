"""SyncBatchNorm's per-channel kernels: a forward and backward of batch norm (one process).

Timed on the CPU against ``torch.nn.BatchNorm`` (PyTorch's fused CPU kernels). Counted under the
interpreter: the Triton path takes 4 launches (statistics, normalise, backward sums, backward
elementwise); its minimum traffic is reading ``x`` and ``dy`` and writing ``y`` and ``dx`` once each
(plus ``z``/``dz`` with a residual), and the eager count is ``nn.BatchNorm`` (+ add + relu) doing the same.
"""

import torch
import torch.nn.functional as F

from apex.parallel import SyncBatchNorm
from benchmarks._harness import Case, Counted


def _pair(shape, channel_last=False, with_z=False, fuse_relu=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).requires_grad_()
    z = torch.randn(shape, generator=g).requires_grad_() if with_z else None
    dy = torch.randn(shape, generator=g)
    C = shape[-1] if channel_last else shape[1]
    ours = SyncBatchNorm(C, channel_last=channel_last, fuse_relu=fuse_relu)
    ref = torch.nn.BatchNorm2d(C)

    def run_ours():
        y = ours(x, z) if with_z else ours(x)
        y.backward(dy)

    def run_torch():
        xin = x.movedim(-1, 1) if channel_last else x
        y = ref(xin)
        if channel_last:
            y = y.movedim(1, -1)
        if with_z:
            y = y + z
        if fuse_relu:
            y = F.relu(y)
        y.backward(dy)

    n_io = 4 + (2 if with_z else 0)  # x, dy, y, dx (+ z, dz)
    return run_ours, run_torch, n_io * x.numel() * x.element_size()


def _case(name, big, small, **kw):
    def timed():
        ours, theirs, _ = _pair(big, **kw)
        return ours, theirs

    def counted():
        ours, theirs, nbytes = _pair(small, seed=1, **kw)
        return Counted(triton=ours, eager=theirs, bytes_min=nbytes)

    return Case(name, timed=timed, counted=counted, torch_label="nn.BatchNorm2d", repeats=21, warmup=3)


def cases():
    return [
        _case("sync_batch_norm fwd+bwd NCHW 32x64x28x28", (32, 64, 28, 28), (4, 16, 9, 11)),
        _case("sync_batch_norm fwd+bwd NHWC+z+relu 32x28x28x64", (32, 28, 28, 64), (4, 9, 11, 16),
              channel_last=True, with_z=True, fuse_relu=True),
    ]
