"""RMSNorm forward and backward: CPU time against ``F.rms_norm`` and a plain-PyTorch RMSNorm; Triton
bytes and launches.

Counted under the interpreter at (256 × 1024), (32 × 8192) and (8 × 16384) fp32. Minimum bytes: forward
reads x and weight and writes y and rstd; backward reads dy, x, weight, rstd and writes dx and dweight. The
Triton backward also writes and reads one fp32 row of partial dweight per program.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._harness import Case, Counted

# Rows of 16384 fp32: the GPU formula's backward is the column-chunked one there (apex._kernels._norm_wide), which
# benchmarks/compile_kernels.py so compiles; the interpreter's counts are the one-pass kernel's.
TIMED = [(4096, 1024), (1024, 8192), (256, 16384)]
COUNTED = {(4096, 1024): (256, 1024), (1024, 8192): (32, 8192), (256, 16384): (8, 16384)}


def _plain_rms(x, w, eps=1e-5):
    """The usual hand-written RMSNorm (Hugging Face / Megatron style)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _inputs(m, n, grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, n, generator=g)
    w = 1 + 0.1 * torch.randn(n, generator=g)
    dy = torch.randn(m, n, generator=g)
    if grad:
        x.requires_grad_()
        w.requires_grad_()
    return x, w, dy


def _fwd_timed(m, n, plain=False):
    from apex.ops.rms_norm import rms_norm

    x, w, _ = _inputs(m, n)
    theirs = (lambda: _plain_rms(x, w)) if plain else (lambda: F.rms_norm(x, (n,), w, 1e-5))
    return (lambda: rms_norm(x, (n,), w, 1e-5)), theirs


def _bwd_timed(m, n, plain=False):
    from apex.ops.rms_norm import rms_norm

    x, w, dy = _inputs(m, n, grad=True)
    ours_y = rms_norm(x, (n,), w, 1e-5)
    ref_y = _plain_rms(x, w) if plain else F.rms_norm(x, (n,), w, 1e-5)
    return (lambda: torch.autograd.grad(ours_y, (x, w), dy, retain_graph=True),
            lambda: torch.autograd.grad(ref_y, (x, w), dy, retain_graph=True))


def _fwd_counted(m, n):
    from apex.ops.rms_norm import rms_norm

    x, w, _ = _inputs(m, n)
    return Counted(triton=lambda: rms_norm(x, (n,), w, 1e-5), eager=lambda: _plain_rms(x, w),
                   bytes_min=2 * x.nbytes + w.nbytes + 4 * m,
                   note=f"x-proportional minimum 2*x = {2 * x.nbytes} B; eager = plain-PyTorch RMSNorm")


def _bwd_counted(m, n):
    import apex
    from apex._kernels._norm import plan
    from apex.ops.rms_norm import rms_norm

    x, w, dy = _inputs(m, n, grad=True)
    with apex.backend("triton"):
        y = rms_norm(x, (n,), w, 1e-5)
    y_eager = _plain_rms(x, w)
    progs = plan(x.detach(), True, True)[1]
    return Counted(triton=lambda: torch.autograd.grad(y, (x, w), dy, retain_graph=True),
                   eager=lambda: torch.autograd.grad(y_eager, (x, w), dy, retain_graph=True),
                   bytes_min=3 * x.nbytes + 2 * w.nbytes + 4 * m,
                   note=f"{progs} programs; per-program partials: {progs * n * 4} distinct B, counted in "
                        "triton bytes")


def cases() -> list[Case]:
    out = []
    for m, n in TIMED:
        cm, cn = COUNTED[(m, n)]
        out.append(Case(f"rms_norm_fwd_{m}x{n}", timed=lambda m=m, n=n: _fwd_timed(m, n),
                        counted=lambda cm=cm, cn=cn: _fwd_counted(cm, cn), torch_label="F.rms_norm"))
        out.append(Case(f"rms_norm_fwd_{m}x{n}_vs_plain", timed=lambda m=m, n=n: _fwd_timed(m, n, True),
                        torch_label="plain RMSNorm"))
        out.append(Case(f"rms_norm_bwd_{m}x{n}", timed=lambda m=m, n=n: _bwd_timed(m, n),
                        counted=lambda cm=cm, cn=cn: _bwd_counted(cm, cn), torch_label="F.rms_norm backward"))
        out.append(Case(f"rms_norm_bwd_{m}x{n}_vs_plain", timed=lambda m=m, n=n: _bwd_timed(m, n, True),
                        torch_label="plain RMSNorm backward"))
    return out


# ----------------------------------------------------------------------------- GPU-sized cases (--device cuda)
GPU_SHAPES = [(16384, 4096), (65536, 1024), (32768, 2048), (8192, 8192), (4096, 16384)]
EPS = 1e-5


def _gpu_inputs(shape, dtype, device):
    from benchmarks._gpu import generator, randn

    m, n = shape
    g = generator(device)
    return {"x": randn((m, n), dtype, device, g), "w": randn((n,), dtype, device, g, 0.1, 1.0),
            "dy": randn((m, n), dtype, device, g)}


def gpu_bytes(shape, dtype, mode) -> int:
    """fwd: read x, w; write y and the fp32 rstd the backward uses. bwd: read dy, x, w, rstd; write dx, dw."""
    m, n = shape
    s = dtype.itemsize
    if mode == "fwd":
        return 2 * m * n * s + n * s + 4 * m
    return 3 * m * n * s + 2 * n * s + 4 * m


def _liger(inputs):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    from benchmarks._gpu import Impl

    # Liger's defaults (LigerRMSNorm): "llama" casting, dX written into dY (each implementation has its own dy).
    x, w = inputs["x"], inputs["w"]
    return Impl(forward=lambda: LigerRMSNormFunction.apply(x, w, EPS), leaves=(x, w), dy=inputs["dy"])


def gpu_cases(shapes=GPU_SHAPES, dtypes=None) -> list:
    from benchmarks._gpu import DTYPES, liger_available, op_cases

    def apex_rms(i):
        from apex.ops.rms_norm import rms_norm

        return rms_norm(i["x"], i["x"].shape[-1:], i["w"], EPS)

    def torch_rms(i):
        return F.rms_norm(i["x"], i["x"].shape[-1:], i["w"], EPS)

    return op_cases("rms_norm", shapes, dtypes or DTYPES, ("fwd", "bwd"), _gpu_inputs,
                    {"apex": apex_rms, "torch": torch_rms}, gpu_bytes, ("x", "w"),
                    builders={"liger": _liger} if liger_available() else None)
