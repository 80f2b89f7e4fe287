"""LayerNorm forward and backward: CPU time against ``F.layer_norm``; Triton bytes and launches.

Counted under the interpreter at (256 × 1024), (32 × 8192) and (8 × 16384) fp32 (same row lengths as the
timed shapes, fewer rows). Minimum bytes: forward reads x, weight, bias and writes y, mean, rstd; backward
reads dy, x, weight, mean, rstd and writes dx, dweight, dbias. The Triton backward also writes and reads one
fp32 row of partial dweight/dbias per program (deterministic reduction); the note gives the ratio without
them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._harness import Case, Counted

# Rows of 16384 fp32: the GPU formula's backward is the column-chunked one there (apex._kernels._norm_wide), which
# benchmarks/compile_kernels.py so compiles; the interpreter's counts are the one-pass kernel's.
TIMED = [(4096, 1024), (1024, 8192), (256, 16384)]
COUNTED = {(4096, 1024): (256, 1024), (1024, 8192): (32, 8192), (256, 16384): (8, 16384)}


def _inputs(m, n, grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g)
    w = 1 + 0.1 * torch.randn(n, generator=g)
    b = 0.1 * torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g)
    if grad:
        x.requires_grad_()
        w.requires_grad_()
        b.requires_grad_()
    return x, w, b, dy


def _fwd_timed(m, n):
    from apex.ops.layer_norm import layer_norm

    x, w, b, _ = _inputs(m, n)
    return (lambda: layer_norm(x, (n,), w, b, 1e-5)), (lambda: F.layer_norm(x, (n,), w, b, 1e-5))


def _bwd_timed(m, n):
    from apex.ops.layer_norm import layer_norm

    x, w, b, dy = _inputs(m, n, grad=True)
    ours_y = layer_norm(x, (n,), w, b, 1e-5)
    ref_y = F.layer_norm(x, (n,), w, b, 1e-5)
    return (lambda: torch.autograd.grad(ours_y, (x, w, b), dy, retain_graph=True),
            lambda: torch.autograd.grad(ref_y, (x, w, b), dy, retain_graph=True))


def _fwd_counted(m, n):
    from apex.ops.layer_norm import layer_norm

    x, w, b, _ = _inputs(m, n)
    minimum = 2 * x.nbytes + w.nbytes + b.nbytes + 2 * 4 * m
    return Counted(triton=lambda: layer_norm(x, (n,), w, b, 1e-5),
                   eager=lambda: F.layer_norm(x, (n,), w, b, 1e-5), bytes_min=minimum,
                   note=f"x-proportional minimum 2*x = {2 * x.nbytes} B")


def _bwd_counted(m, n):
    import apex
    from apex.ops.layer_norm import layer_norm

    x, w, b, dy = _inputs(m, n, grad=True)
    with apex.backend("triton"):
        y = layer_norm(x, (n,), w, b, 1e-5)
    y_eager = F.layer_norm(x, (n,), w, b, 1e-5)
    minimum = 3 * x.nbytes + 3 * w.nbytes + 2 * 4 * m  # dy, x, dx; w, dw, db; mean, rstd
    from apex._kernels._norm import plan

    progs = plan(x.detach(), False, True)[1]
    partials = 2 * progs * n * 4  # distinct bytes of the dweight and dbias partials (written, then read)
    return Counted(triton=lambda: torch.autograd.grad(y, (x, w, b), dy, retain_graph=True),
                   eager=lambda: torch.autograd.grad(y_eager, (x, w, b), dy, retain_graph=True),
                   bytes_min=minimum,
                   note=f"{progs} programs; per-program partials: {partials} distinct B, counted in triton bytes")


def cases() -> list[Case]:
    out = []
    for m, n in TIMED:
        cm, cn = COUNTED[(m, n)]
        out.append(Case(f"layer_norm_fwd_{m}x{n}", timed=lambda m=m, n=n: _fwd_timed(m, n),
                        counted=lambda cm=cm, cn=cn: _fwd_counted(cm, cn), torch_label="F.layer_norm"))
        out.append(Case(f"layer_norm_bwd_{m}x{n}", timed=lambda m=m, n=n: _bwd_timed(m, n),
                        counted=lambda cm=cm, cn=cn: _bwd_counted(cm, cn),
                        torch_label="F.layer_norm backward"))
    return out


# ----------------------------------------------------------------------------- GPU-sized cases (--device cuda)
GPU_SHAPES = [(16384, 4096), (65536, 1024), (32768, 2048), (8192, 8192), (4096, 16384)]
EPS = 1e-5


def _gpu_inputs(shape, dtype, device):
    from benchmarks._gpu import generator, randn

    m, n = shape
    g = generator(device)
    return {"x": randn((m, n), dtype, device, g), "w": randn((n,), dtype, device, g, 0.1, 1.0),
            "b": randn((n,), dtype, device, g, 0.1), "dy": randn((m, n), dtype, device, g)}


def gpu_bytes(shape, dtype, mode) -> int:
    """fwd: read x, w, b; write y and the fp32 mean and rstd the backward uses. bwd: read dy, x, w, mean,
    rstd; write dx, dw, db."""
    m, n = shape
    s = dtype.itemsize
    if mode == "fwd":
        return 2 * m * n * s + 2 * n * s + 2 * 4 * m
    return 3 * m * n * s + 3 * n * s + 2 * 4 * m


def _liger(inputs):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    from benchmarks._gpu import Impl

    x, w, b = inputs["x"], inputs["w"], inputs["b"]
    return Impl(forward=lambda: LigerLayerNormFunction.apply(x, w, b, EPS), leaves=(x, w, b), dy=inputs["dy"])


def gpu_cases(shapes=GPU_SHAPES, dtypes=None) -> list:
    from benchmarks._gpu import DTYPES, liger_available, op_cases

    def apex_ln(i):
        from apex.ops.layer_norm import layer_norm

        return layer_norm(i["x"], i["x"].shape[-1:], i["w"], i["b"], EPS)

    def torch_ln(i):
        return F.layer_norm(i["x"], i["x"].shape[-1:], i["w"], i["b"], EPS)

    return op_cases("layer_norm", shapes, dtypes or DTYPES, ("fwd", "bwd"), _gpu_inputs,
                    {"apex": apex_ln, "torch": torch_ln}, gpu_bytes, ("x", "w", "b"),
                    builders={"liger": _liger} if liger_available() else None)
