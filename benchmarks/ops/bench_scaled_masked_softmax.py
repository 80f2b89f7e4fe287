"""Scale-mask-softmax forward and backward (causal and padding, sk = 2048 and 8192): CPU time against the unfused
PyTorch composition Megatron-LM falls back to (``x.float() * scale``, ``masked_fill(mask, -10000)``,
``softmax``, cast back); Triton bytes and launches.

Timed in bf16 on the CPU. Counted in fp16 under the interpreter on fewer rows of the same row length
(padding: [1, 2, 4, sk]; causal: [1, 1, sk, sk] at sk = 2048 and a [1, 1, 1024, 1024] stand-in for 8192, whose
67M-element square is too big for the interpreter). Minimum bytes: every input read once and every output
written once (forward x, mask, y; backward dy, y, dx). The kernels never load masked scores (padding) nor the
upper triangle (causal), so they move less than that.
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted

SCALE = 0.125
# (kind, sk) -> timed shape, counted shape
SHAPES = {
    ("padding", 2048): ((2, 8, 256, 2048), (1, 2, 4, 2048)),
    ("padding", 8192): ((1, 8, 128, 8192), (1, 2, 4, 8192)),
    ("causal", 2048): ((1, 4, 2048, 2048), (1, 1, 2048, 2048)),
    ("causal", 8192): ((1, 1, 8192, 8192), (1, 1, 1024, 1024)),
}


def _inputs(shape, kind, dtype, grad=False):
    g = torch.Generator().manual_seed(0)
    b, _, sq, sk = shape
    x = torch.randn(shape, generator=g).to(dtype)
    if kind == "causal":
        mask = torch.ones(1, 1, sq, sk, dtype=torch.bool).triu_(1)   # what Megatron's unfused path is given
    else:
        mask = torch.rand(b, 1, sq, sk, generator=g) < 0.2
    dy = torch.randn(shape, generator=g).to(dtype)
    if grad:
        x.requires_grad_()
    return x, mask, dy


def _unfused(x, mask):
    """Megatron-LM's ``forward_torch_softmax`` with ``softmax_in_fp32`` and a scale."""
    s = x.float() * SCALE
    s = s.masked_fill(mask, -10000.0)
    return torch.softmax(s, dim=-1).to(x.dtype)


def _ours(x, mask, kind):
    from apex.ops.scaled_masked_softmax import scaled_masked_softmax

    return scaled_masked_softmax(x, None if kind == "causal" else mask, SCALE, causal=kind == "causal")


def _fwd_timed(kind, shape):
    x, mask, _ = _inputs(shape, kind, torch.bfloat16)
    return (lambda: _ours(x, mask, kind)), (lambda: _unfused(x, mask))


def _bwd_timed(kind, shape):
    x, mask, dy = _inputs(shape, kind, torch.bfloat16, grad=True)
    y_ours, y_ref = _ours(x, mask, kind), _unfused(x, mask)
    return (lambda: torch.autograd.grad(y_ours, x, dy, retain_graph=True),
            lambda: torch.autograd.grad(y_ref, x, dy, retain_graph=True))


def _fwd_counted(kind, shape):
    x, mask, _ = _inputs(shape, kind, torch.float16)
    need = x.nbytes * 2 + (mask.nbytes if kind == "padding" else 0)
    return Counted(triton=lambda: _ours(x, mask, kind), eager=lambda: _unfused(x, mask), bytes_min=need,
                   note=f"shape {list(shape)}; min = x + {'mask + ' if kind == 'padding' else ''}y, each once")


def _bwd_counted(kind, shape):
    import apex

    x, mask, dy = _inputs(shape, kind, torch.float16, grad=True)
    with apex.backend("triton"):
        y = _ours(x, mask, kind)
    y_eager = _unfused(x, mask)
    return Counted(triton=lambda: torch.autograd.grad(y, x, dy, retain_graph=True),
                   eager=lambda: torch.autograd.grad(y_eager, x, dy, retain_graph=True),
                   bytes_min=3 * x.nbytes, note=f"shape {list(shape)}; min = dy + y + dx, each once")


def cases() -> list[Case]:
    out = []
    for (kind, sk), (timed, counted) in SHAPES.items():
        reps = dict(repeats=3, warmup=1) if timed[-1] * timed[-2] * timed[1] * timed[0] > 2**25 else {}
        out.append(Case(f"softmax_{kind}_fwd_sk{sk}", timed=lambda k=kind, s=timed: _fwd_timed(k, s),
                        counted=lambda k=kind, s=counted: _fwd_counted(k, s),
                        torch_label="unfused scale/mask/softmax (bf16)", **reps))
        out.append(Case(f"softmax_{kind}_bwd_sk{sk}", timed=lambda k=kind, s=timed: _bwd_timed(k, s),
                        counted=lambda k=kind, s=counted: _bwd_counted(k, s),
                        torch_label="unfused backward (bf16)", **reps))
    return out


# ----------------------------------------------------------------------------- GPU-sized cases (--device cuda)
GPU_SHAPES = [(1, 128, 2048, 2048)]  # causal (upper-triangular) softmax of 128 heads' 2048 x 2048 scores


def _gpu_inputs(shape, dtype, device):
    from benchmarks._gpu import generator, randn

    g = generator(device)
    sq, sk = shape[-2:]
    # The mask only feeds the eager composition (what Megatron's unfused path is given); apex's causal
    # kernel needs none, and the minimum bytes count none.
    mask = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=device).triu_(1)
    return {"x": randn(shape, dtype, device, g, 4.0), "mask": mask, "dy": randn(shape, dtype, device, g)}


def gpu_bytes(shape, dtype, mode) -> int:
    """fwd: read x, write y. bwd: read dy and y, write dx."""
    n = 1
    for d in shape:
        n *= d
    return (2 if mode == "fwd" else 3) * n * dtype.itemsize


def gpu_cases(shapes=GPU_SHAPES, dtypes=None) -> list:
    from benchmarks._gpu import DTYPES, op_cases

    return op_cases("softmax_causal", shapes, dtypes or DTYPES, ("fwd", "bwd"), _gpu_inputs,
                    {"apex": lambda i: _ours(i["x"], None, "causal"), "torch": lambda i: _unfused(i["x"], i["mask"])},
                    gpu_bytes, ("x",), note="torch: Megatron's unfused scale/mask/softmax in fp32")
