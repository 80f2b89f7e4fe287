"""Fused RoPE forward and backward: CPU time against upstream's unfused PyTorch formula
(``t·cos + rotate_half(t)·sin`` then ``cat`` with the pass-through columns); Triton bytes and launches.

Counted under the interpreter at ``[16, 2, 8, 64]`` fp32 with half the head dim rotated. Minimum bytes:
read ``t`` (or ``dy``) and the angle table once, write the output once.
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted

TIMED = (1024, 2, 16, 128)
COUNTED = (16, 2, 8, 64)


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _unfused(t, freqs):
    """Megatron-LM's / upstream's test reference ``apply_rotary_pos_emb``."""
    r = freqs.shape[-1]
    x, rest = t[..., :r], t[..., r:]
    x = x * torch.cos(freqs).to(t.dtype) + _rotate_half(x) * torch.sin(freqs).to(t.dtype)
    return torch.cat((x, rest), dim=-1)


def _unfused_thd(t, cu, freqs):
    lens = (cu[1:] - cu[:-1]).tolist()
    return torch.cat([_unfused(x.unsqueeze(1), freqs[: x.size(0)]) for x in torch.split(t, lens)]).squeeze(1)


def _inputs(shape, rot_frac=0.5, grad=False):
    g = torch.Generator().manual_seed(0)
    s, b, h, d = shape
    t = torch.randn(s, b, h, d, generator=g, requires_grad=grad)
    freqs = torch.rand(s, 1, 1, int(d * rot_frac), generator=g) * 6
    dy = torch.randn(s, b, h, d, generator=g)
    return t, freqs, dy


def _fwd_timed(shape):
    from apex.ops.fused_rope import fused_rope

    t, freqs, _ = _inputs(shape)
    return (lambda: fused_rope(t, freqs)), (lambda: _unfused(t, freqs))


def _bwd_timed(shape):
    from apex.ops.fused_rope import fused_rope

    t, freqs, dy = _inputs(shape, grad=True)
    ours, theirs = fused_rope(t, freqs), _unfused(t, freqs)
    return (lambda: torch.autograd.grad(ours, t, dy, retain_graph=True),
            lambda: torch.autograd.grad(theirs, t, dy, retain_graph=True))


def _thd_timed(shape):
    from apex.ops.fused_rope import fused_rope_thd

    s, b, h, d = shape
    t, freqs, _ = _inputs((s * b, 1, h, d))
    t = t[:, 0]
    cu = torch.tensor([0, s // 3, s // 2, s + 5, s * b], dtype=torch.int32)
    return (lambda: fused_rope_thd(t, cu, freqs)), (lambda: _unfused_thd(t, cu, freqs))


def _fwd_counted(shape):
    from apex.ops.fused_rope import fused_rope

    t, freqs, _ = _inputs(shape)
    return Counted(triton=lambda: fused_rope(t, freqs), eager=lambda: _unfused(t, freqs),
                   bytes_min=2 * t.nbytes + freqs.nbytes, note="eager = upstream's unfused formula")


def _bwd_counted(shape):
    import apex
    from apex.ops.fused_rope import fused_rope

    t, freqs, dy = _inputs(shape, grad=True)
    with apex.backend("triton"):
        y = fused_rope(t, freqs)
    y_eager = _unfused(t, freqs)
    return Counted(triton=lambda: torch.autograd.grad(y, t, dy, retain_graph=True),
                   eager=lambda: torch.autograd.grad(y_eager, t, dy, retain_graph=True),
                   bytes_min=2 * t.nbytes + freqs.nbytes, note="eager = autograd of upstream's unfused formula")


def _thd_counted(shape):
    from apex.ops.fused_rope import fused_rope_thd

    s, b, h, d = shape
    t, freqs, _ = _inputs((s * b, 1, h, d))
    t = t[:, 0]
    cu = torch.tensor([0, 5, 11, s * b], dtype=torch.int32)
    return Counted(triton=lambda: fused_rope_thd(t, cu, freqs), eager=lambda: _unfused_thd(t, cu, freqs),
                   bytes_min=2 * t.nbytes + freqs[: int((cu[1:] - cu[:-1]).max())].nbytes + cu.nbytes,
                   note="eager = upstream's per-sequence reference; minimum: t twice, the angle rows of the "
                        "longest sequence and cu_seqlens once")


def cases() -> list[Case]:
    name = "x".join(map(str, TIMED))
    return [
        Case(f"fused_rope_fwd_{name}", timed=lambda: _fwd_timed(TIMED), counted=lambda: _fwd_counted(COUNTED),
             torch_label="unfused rope"),
        Case(f"fused_rope_bwd_{name}", timed=lambda: _bwd_timed(TIMED), counted=lambda: _bwd_counted(COUNTED),
             torch_label="unfused rope backward"),
        Case(f"fused_rope_thd_fwd_{name}", timed=lambda: _thd_timed(TIMED), counted=lambda: _thd_counted(COUNTED),
             torch_label="per-sequence unfused rope"),
    ]


# ----------------------------------------------------------------------------- GPU-sized cases (--device cuda)
GPU_SHAPES = [(4096, 4, 32, 128)]  # sbhd, full rotary dim


def _gpu_inputs(shape, dtype, device):
    from benchmarks._gpu import generator, randn

    s, b, h, d = shape
    g = generator(device)
    # Llama's angles: position x 10000^(-2i/d), the same for both halves (as cat(freqs, freqs) makes them).
    inv = 10000.0 ** (-torch.arange(0, d // 2, device=device, dtype=torch.float32) * 2 / d)
    half = torch.arange(s, device=device, dtype=torch.float32)[:, None] * inv
    freqs = torch.cat((half, half), -1).reshape(s, 1, 1, d)
    return {"t": randn(shape, dtype, device, g), "freqs": freqs, "dy": randn(shape, dtype, device, g)}


def gpu_bytes(shape, dtype, mode) -> int:
    """fwd: read t and the fp32 angle table, write y. bwd: read dy and the table, write dx."""
    s, b, h, d = shape
    return 2 * s * b * h * d * dtype.itemsize + s * d * 4


def _liger(inputs):
    """Liger's RoPE rotates q and k of layout (b, h, s, d) over (b, s, h, d) memory with cos/sin (1, s, d) in
    the model's dtype: t's heads are split into a q and a k half, laid out so (copies made once, untimed)."""
    from liger_kernel.ops.rope import LigerRopeFunction

    from benchmarks._gpu import Impl

    t, freqs = inputs["t"], inputs["freqs"]
    s, b, h, d = t.shape
    bshd = t.detach().permute(1, 0, 2, 3)
    q = bshd[:, :, : h // 2].contiguous().requires_grad_()
    k = bshd[:, :, h // 2:].contiguous().requires_grad_()
    cos = torch.cos(freqs).reshape(1, s, d).to(t.dtype)
    sin = torch.sin(freqs).reshape(1, s, d).to(t.dtype)
    dyb = inputs["dy"].permute(1, 0, 2, 3)
    dq = dyb[:, :, : h // 2].contiguous().transpose(1, 2)
    dk = dyb[:, :, h // 2:].contiguous().transpose(1, 2)

    def grads_back(pair):  # (dq, dk), each (b, s, h/2, d) -> t's (s, b, h, d)
        return torch.cat(pair, 2).permute(1, 0, 2, 3)

    return Impl(forward=lambda: LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin),
                leaves=(q, k), dy=(dq, dk), grads_to_ref=grads_back,
                out_to_ref=lambda pair: grads_back([p.transpose(1, 2) for p in pair]))


def gpu_cases(shapes=GPU_SHAPES, dtypes=None) -> list:
    from benchmarks._gpu import DTYPES, liger_available, op_cases

    def apex_rope(i):
        from apex.ops.fused_rope import fused_rope

        return fused_rope(i["t"], i["freqs"])

    return op_cases("rope_sbhd", shapes, dtypes or DTYPES, ("fwd", "bwd"), _gpu_inputs,
                    {"apex": apex_rope, "torch": lambda i: _unfused(i["t"], i["freqs"])}, gpu_bytes, ("t",),
                    builders={"liger": _liger} if liger_available() else None,
                    note="torch: Megatron's unfused formula; liger: q and k halves of the heads, bshd memory")
