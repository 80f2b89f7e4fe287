"""OpenFold attention (``AttnTri``): CPU time against upstream's eager formula (matmul, mask, bias, softmax,
matmul); Triton bytes and launches of the flash-attention kernels.

Minimum bytes: forward reads q, k, v, the mask and the bias once and writes o and the fp32 log-sum-exp;
backward reads q, k, v, o, do, mask, bias, lse and writes dq, dk, dv and dbias. The Triton backward also
writes and re-reads the fp32 score gradient ``[Z, H, NQ, NK]`` that is summed into dbias.
"""

from __future__ import annotations

import math

import torch

from benchmarks._harness import Case, Counted

TIMED = (16, 4, 128, 32)    # B, H, N, D of [1, B, H, N, D]
COUNTED = (2, 2, 64, 32)


def _eager(q, k, v, mask, bias, inf=1e9):
    a = torch.matmul(q * (1.0 / math.sqrt(q.size(-1))), k.transpose(-1, -2))
    a += (mask - 1.0) * inf
    a += bias
    return torch.matmul(torch.softmax(a, dim=-1), v)


def _inputs(shape, grad=False):
    bsz, h, n, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, bsz, h, n, d, generator=g) for _ in range(3))
    mask = (torch.rand(1, bsz, 1, 1, n, generator=g) > 0.2).float()
    bias = torch.randn(1, 1, h, n, n, generator=g)
    do = torch.randn(1, bsz, h, n, d, generator=g)
    if grad:
        for t in (q, k, v, bias):
            t.requires_grad_()
    return q, k, v, mask, bias, do


def _ours(q, k, v, mask, bias):
    from apex.contrib.openfold_triton import AttnTri

    return AttnTri(q, k, v, mask, bias, 1e9, True)


def _fwd_timed():
    q, k, v, mask, bias, _ = _inputs(TIMED)
    return (lambda: _ours(q, k, v, mask, bias)), (lambda: _eager(q, k, v, mask, bias))


def _bwd_timed():
    q, k, v, mask, bias, do = _inputs(TIMED, grad=True)
    o = _ours(q, k, v, mask, bias)
    oe = _eager(q, k, v, mask, bias)
    return (lambda: torch.autograd.grad(o, (q, k, v, bias), do, retain_graph=True),
            lambda: torch.autograd.grad(oe, (q, k, v, bias), do, retain_graph=True))


def _fwd_counted():
    q, k, v, mask, bias, _ = _inputs(COUNTED)
    lse = q.numel() // q.shape[-1] * 4
    return Counted(triton=lambda: _ours(q, k, v, mask, bias), eager=lambda: _eager(q, k, v, mask, bias),
                   bytes_min=4 * q.nbytes + mask.nbytes + bias.nbytes + lse)


def _bwd_counted():
    import apex

    q, k, v, mask, bias, do = _inputs(COUNTED, grad=True)
    with apex.backend("triton"):
        o = _ours(q, k, v, mask, bias)
    oe = _eager(q, k, v, mask, bias)
    lse = q.numel() // q.shape[-1] * 4
    ds = q.shape[1] * q.shape[2] * q.shape[3] * k.shape[3] * 4
    return Counted(triton=lambda: torch.autograd.grad(o, (q, k, v, bias), do, retain_graph=True),
                   eager=lambda: torch.autograd.grad(oe, (q, k, v, bias), do, retain_graph=True),
                   bytes_min=8 * q.nbytes + mask.nbytes + 2 * bias.nbytes + 2 * lse,
                   note=f"fp32 score gradient for dbias: {ds} B written + read")


def cases() -> list[Case]:
    b, h, n, d = TIMED
    return [
        Case(f"openfold_attention_fwd_1x{b}x{h}x{n}x{d}", timed=_fwd_timed, counted=_fwd_counted,
             torch_label="eager matmul+softmax"),
        Case(f"openfold_attention_bwd_1x{b}x{h}x{n}x{d}", timed=_bwd_timed, counted=_bwd_counted,
             torch_label="eager backward"),
    ]
