"""RNN-T joint (``h = relu(f[:, :, None] + g[:, None])``) forward + backward: CPU time against the PyTorch
broadcast composition with autograd (what NeMo runs without Apex); Triton bytes and launches.

Dense output, fp32, ReLU on. Counted under the interpreter at B=3, T=9, U=5, H=40. Minimum bytes: read f and
g and write h (forward), read dh and write df and dg (backward); the ReLU mask is one byte per element of h
written forward and read backward. Ragged lengths: cells outside ``f_len``/``g_len`` are written once (−1)
and never read.
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted

TIMED = (8, 200, 50, 320)  # B, T, U, H: ~25M joint elements
COUNTED = (3, 9, 5, 40)


def _inputs(B, T, U, H):
    g = torch.Generator().manual_seed(0)
    f = torch.randn(B, T, H, generator=g).requires_grad_()
    gg = torch.randn(B, U, H, generator=g).requires_grad_()
    f_len = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=torch.int32)
    g_len = torch.randint(U // 2, U + 1, (B,), generator=g, dtype=torch.int32)
    f_len[0], g_len[0] = T, U
    dh = torch.randn(B, T, U, H, generator=g)
    return f, gg, f_len, g_len, dh


def _ours(f, g, f_len, g_len, dh):
    from apex.ops.transducer_joint import transducer_joint

    h = transducer_joint(f, g, f_len, g_len, relu=True)
    return torch.autograd.grad(h, (f, g), dh)


def _torch(f, g, f_len, g_len, dh):
    h = torch.relu(f[:, :, None] + g[:, None])
    return torch.autograd.grad(h, (f, g), dh)


def _timed():
    args = _inputs(*TIMED)
    return (lambda: _ours(*args)), (lambda: _torch(*args))


def _counted():
    f, g, f_len, g_len, dh = args = _inputs(*COUNTED)
    return Counted(triton=lambda: _ours(*args), eager=lambda: _torch(*args),
                   bytes_min=2 * (f.nbytes + g.nbytes + dh.nbytes) + 2 * dh.numel(),
                   note="eager = broadcast add + relu with autograd; min includes a 1-byte ReLU mask")


def cases() -> list[Case]:
    name = "x".join(map(str, TIMED))
    return [Case(f"transducer_joint_relu_fwd_bwd_{name}", timed=_timed, counted=_counted,
                 torch_label="broadcast add + relu, autograd")]
