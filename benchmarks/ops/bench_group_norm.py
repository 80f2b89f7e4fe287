"""GroupNorm + SiLU on NHWC (channels_last) inputs (``apex.ops.group_norm``).

CPU time against PyTorch's composition ``F.silu(F.group_norm(x))`` at (8, 320, 32, 32), 32 groups, fp32,
forward and backward. Triton bytes and launches under the interpreter: (2, 64, 8, 8), 32 groups (each
group fits one tile: one launch, x read once), and (1, 64, 64, 64), 4 groups with the GPU's tile limits
(16 channels × 4096 positions per group: split over programs, statistics then apply, x read twice).
Minimum: forward reads x and the parameters and writes y and the (mean, rstd) pairs; backward reads dy,
x, parameters and statistics and writes dx, dweight and dbias.

On NHWC, PyTorch's channels_last CPU kernel computes the variance in one pass and loses up to 1e-4
relative accuracy on groups whose mean is large against their spread; apex's CPU path keeps two-pass
statistics (two sums over the positions with the channels contiguous) at about the same speed.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from benchmarks._harness import Case, Counted

CL = torch.channels_last


def _inputs(shape, grad=False):
    g = torch.Generator().manual_seed(0)
    c = shape[1]
    x = torch.randn(shape, generator=g).to(memory_format=CL)
    w = 1 + 0.1 * torch.randn(c, generator=g)
    b = 0.1 * torch.randn(c, generator=g)
    dy = torch.randn(shape, generator=g).to(memory_format=CL)
    if grad:
        for t in (x, w, b):
            t.requires_grad_()
    return x, w, b, dy


def _ours(x, groups, w, b):
    from apex.ops.group_norm import group_norm

    return group_norm(x, groups, w, b, 1e-5, "silu")


def _theirs(x, groups, w, b):
    return F.silu(F.group_norm(x, groups, w, b, 1e-5))


@contextlib.contextmanager
def _gpu_tiles(on: bool):
    from apex._kernels import group_norm as kernels

    saved = dict(kernels.LIMITS)
    if on:
        kernels.LIMITS.update(tile=4096, fuse_max=16384)
    try:
        yield
    finally:
        kernels.LIMITS.update(saved)


def _fwd_timed(shape, groups):
    x, w, b, _ = _inputs(shape)
    return (lambda: _ours(x, groups, w, b)), (lambda: _theirs(x, groups, w, b))


def _bwd_timed(shape, groups):
    x, w, b, dy = _inputs(shape, grad=True)
    ours, ref = _ours(x, groups, w, b), _theirs(x, groups, w, b)
    return (lambda: torch.autograd.grad(ours, (x, w, b), dy, retain_graph=True),
            lambda: torch.autograd.grad(ref, (x, w, b), dy, retain_graph=True))


def _minimum(x, w, groups, backward):
    stats = 8 * x.shape[0] * groups
    return (3 if backward else 2) * x.nbytes + 2 * (2 if backward else 1) * w.nbytes + stats


def _fwd_counted(shape, groups, gpu_tiles):
    x, w, b, _ = _inputs(shape)

    def run():
        with _gpu_tiles(gpu_tiles):
            return _ours(x, groups, w, b)

    return Counted(triton=run, eager=lambda: _theirs(x, groups, w, b), bytes_min=_minimum(x, w, groups, False),
                   note="eager = F.silu(F.group_norm(x))")


def _bwd_counted(shape, groups, gpu_tiles):
    import apex

    x, w, b, dy = _inputs(shape, grad=True)
    with apex.backend("triton"), _gpu_tiles(gpu_tiles):
        y = _ours(x, groups, w, b)
    y_eager = _theirs(x, groups, w, b)

    def run():
        with _gpu_tiles(gpu_tiles):
            return torch.autograd.grad(y, (x, w, b), dy, retain_graph=True)

    return Counted(triton=run, eager=lambda: torch.autograd.grad(y_eager, (x, w, b), dy, retain_graph=True),
                   bytes_min=_minimum(x, w, groups, True),
                   note="per-sample partial (dweight, dbias) rows are reduced by two PyTorch sums (not counted)")


def cases() -> list[Case]:
    shape, groups = (8, 320, 32, 32), 32
    small, big = ((2, 64, 8, 8), 32, False), ((1, 64, 64, 64), 4, True)
    out = [Case("group_norm_silu_nhwc_fwd_8x320x32x32", timed=lambda: _fwd_timed(shape, groups),
                counted=lambda: _fwd_counted(*small), torch_label="F.silu(F.group_norm)"),
           Case("group_norm_silu_nhwc_bwd_8x320x32x32", timed=lambda: _bwd_timed(shape, groups),
                counted=lambda: _bwd_counted(*small), torch_label="F.silu(F.group_norm) backward"),
           Case("group_norm_silu_nhwc_fwd_split_1x64x64x64", counted=lambda: _fwd_counted(*big)),
           Case("group_norm_silu_nhwc_bwd_split_1x64x64x64", counted=lambda: _bwd_counted(*big))]
    return out
