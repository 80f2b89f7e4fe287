"""OpenFold LayerNorm (``LayerNormSmallShapeOptImpl``): CPU time against ``F.layer_norm``; Triton bytes and
launches on OpenFold-shaped short rows (N = 128), contiguous and as a transposed 4-D view read in place.

Minimum bytes: forward reads x, weight, bias and writes y, mean and rstd (8 B per row); backward reads dy, x,
weight, mean, rstd and writes dx, dweight, dbias. The Triton backward also writes and reads one fp32 row
of partial dweight and dbias per program (4 programs under the interpreter).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._harness import Case, Counted

TIMED = (64, 256, 128)     # [rows_a, rows_b, N]: 2M elements
COUNTED = (4, 64, 128)     # 256 rows of 128 under the interpreter


def _inputs(shape, transposed=False, grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g)
    if transposed:
        x = x.view(shape[0], shape[1] // 8, 8, shape[2]).transpose(1, 2)
    n = shape[-1]
    w = (1 + 0.1 * torch.randn(n, generator=g))
    b = 0.1 * torch.randn(n, generator=g)
    dy = torch.randn(x.shape, generator=g)
    if grad:
        x.requires_grad_()
        w.requires_grad_()
        b.requires_grad_()
    return x, w, b, dy


def _ours(x, w, b):
    from apex.contrib.openfold_triton import LayerNormSmallShapeOptImpl

    return LayerNormSmallShapeOptImpl.apply(x, (x.shape[-1],), w, b, 1e-5)


def _fwd_timed():
    x, w, b, _ = _inputs(TIMED)
    return (lambda: _ours(x, w, b)), (lambda: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5))


def _bwd_timed():
    x, w, b, dy = _inputs(TIMED, grad=True)
    y = _ours(x, w, b)
    yr = F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    return (lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
            lambda: torch.autograd.grad(yr, (x, w, b), dy, retain_graph=True))


def _fwd_counted(transposed):
    x, w, b, _ = _inputs(COUNTED, transposed)
    m = x.numel() // x.shape[-1]
    return Counted(triton=lambda: _ours(x, w, b), eager=lambda: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
                   bytes_min=2 * x.nbytes + w.nbytes + b.nbytes + 8 * m,
                   note="transposed 4-D view read in place" if transposed else "")


def _bwd_counted():
    import apex

    x, w, b, dy = _inputs(COUNTED, grad=True)
    m = x.numel() // x.shape[-1]
    with apex.backend("triton"):
        y = _ours(x, w, b)
    yr = F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)
    return Counted(triton=lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
                   eager=lambda: torch.autograd.grad(yr, (x, w, b), dy, retain_graph=True),
                   bytes_min=3 * x.nbytes + 3 * w.nbytes + 8 * m,
                   note="plus 4 programs x 2 partial rows of fp32")


def cases() -> list[Case]:
    r, c, n = TIMED
    return [
        Case(f"openfold_layer_norm_fwd_{r * c}x{n}", timed=_fwd_timed, counted=lambda: _fwd_counted(False),
             torch_label="F.layer_norm"),
        Case(f"openfold_layer_norm_fwd_transposed_{r * c}x{n}", counted=lambda: _fwd_counted(True),
             torch_label="F.layer_norm"),
        Case(f"openfold_layer_norm_bwd_{r * c}x{n}", timed=_bwd_timed, counted=_bwd_counted,
             torch_label="F.layer_norm backward"),
    ]
