"""``index_mul_2d(in1, in2, idx1) = in1[idx1] * in2`` (``apex.ops.index_mul_2d``).

CPU time against ``in1[idx1] * in2`` with PyTorch's autograd at (1000 × 128, 100000 rows), forward and
backward. Triton bytes and launches under the interpreter at (16 × 64, 512 rows): the forward is one
gather-multiply; the backward is one pass of segment sums over the sorted indices (d in1, deterministic)
that also writes d in2, since a segment's rows all gather the same in1 row (the sort, bincount and cumsum
are PyTorch ops, not counted). Minimum: forward reads
in1, in2, idx1 and writes out; backward reads grad, in1, in2, idx1 and writes both gradients.
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted


def _inputs(r, m, f, grad=False):
    g = torch.Generator().manual_seed(0)
    in1, in2 = torch.randn(r, f, generator=g), torch.randn(m, f, generator=g)
    idx = torch.randint(0, r, (m,), generator=g)
    dy = torch.randn(m, f, generator=g)
    if grad:
        in1.requires_grad_()
        in2.requires_grad_()
    return in1, in2, idx, dy


def _ours(in1, in2, idx):
    from apex.ops.index_mul_2d import index_mul_2d

    return index_mul_2d(in1, in2, idx)


def _fwd_timed(r, m, f):
    in1, in2, idx, _ = _inputs(r, m, f)
    return (lambda: _ours(in1, in2, idx)), (lambda: in1[idx] * in2)


def _bwd_timed(r, m, f):
    in1, in2, idx, dy = _inputs(r, m, f, grad=True)
    ours, ref = _ours(in1, in2, idx), in1[idx] * in2
    return (lambda: torch.autograd.grad(ours, (in1, in2), dy, retain_graph=True),
            lambda: torch.autograd.grad(ref, (in1, in2), dy, retain_graph=True))


def _fwd_counted(r, m, f):
    in1, in2, idx, _ = _inputs(r, m, f)
    return Counted(triton=lambda: _ours(in1, in2, idx), eager=lambda: in1[idx] * in2,
                   bytes_min=in1.nbytes + 2 * in2.nbytes + idx.nbytes)


def _bwd_counted(r, m, f):
    import apex

    in1, in2, idx, dy = _inputs(r, m, f, grad=True)
    with apex.backend("triton"):
        y = _ours(in1, in2, idx)
    y_eager = in1[idx] * in2
    return Counted(triton=lambda: torch.autograd.grad(y, (in1, in2), dy, retain_graph=True),
                   eager=lambda: torch.autograd.grad(y_eager, (in1, in2), dy, retain_graph=True),
                   bytes_min=2 * in1.nbytes + 3 * in2.nbytes + idx.nbytes,
                   note="sorted permutation and segment offsets (int64) are read by the segment sum")


def cases() -> list[Case]:
    big, small = (1000, 100000, 128), (16, 512, 64)
    return [Case("index_mul_2d_fwd_1000x128_100k", timed=lambda: _fwd_timed(*big),
                 counted=lambda: _fwd_counted(*small), torch_label="in1[idx1] * in2"),
            Case("index_mul_2d_bwd_1000x128_100k", timed=lambda: _bwd_timed(*big),
                 counted=lambda: _bwd_counted(*small), torch_label="autograd of in1[idx1] * in2")]
