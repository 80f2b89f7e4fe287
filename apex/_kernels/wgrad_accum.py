"""Weight-gradient accumulation ``W += Gᵀ·A``: ``A`` ``[K, in]``, ``G`` ``[K, out]``, ``W`` ``[out, in]``.

A tiled ``tl.dot`` GEMM: each program owns one ``[BLOCK_O, BLOCK_I]`` tile of ``W``, accumulates
``Σ_k G[k, o]·A[k, i]`` over ``K`` in fp32 registers, then reads its ``W`` tile once, adds and writes it
once (one rounding to ``W``'s dtype). fp32 operands use ``input_precision="ieee"`` (no tf32). Under the
Triton interpreter bf16 operands are upcast to fp32 before the dot (its bf16 dot is wrong).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _wgrad_kernel(A, G, W, K, NI, NO, sak, sai, sgk, sgo, swo, swi,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr,
                  BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr):
    o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    om = o < NO
    im = i < NI
    o64 = o.to(tl.int64)
    i64 = i.to(tl.int64)
    acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        km = k < K
        g = tl.load(G + k[None, :] * sgk + o64[:, None] * sgo, mask=om[:, None] & km[None, :], other=0.0)
        a = tl.load(A + k[:, None] * sak + i64[None, :] * sai, mask=km[:, None] & im[None, :], other=0.0)
        if UPCAST:
            g = g.to(tl.float32)
            a = a.to(tl.float32)
        if IEEE:
            acc = tl.dot(g, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(g, a, acc)
    wp = W + o64[:, None] * swo + i64[None, :] * swi
    wm = om[:, None] & im[None, :]
    w = tl.load(wp, mask=wm, other=0.0).to(tl.float32)
    tl.store(wp, (w + acc).to(W.dtype.element_ty), mask=wm)


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_wgrad_kernel)


def _block(n: int, cap: int) -> int:
    return max(16, min(next_power_of_2(max(n, 1)), cap))


def accumulate(a: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> None:
    """``w += g.T @ a`` in place for 2-D views ``a`` ``[K, in]``, ``g`` ``[K, out]``, ``w`` ``[out, in]``."""
    K, NI = a.shape
    NO = g.shape[1]
    if NI * NO == 0 or K == 0:
        return
    interp = _INTERP
    # Interpreted programs cost per program: larger tiles there; GPU tiles sized for tensor cores.
    bo, bi, bk = (_block(NO, 128), _block(NI, 128), _block(K, 128)) if interp else \
        (_block(NO, 128), _block(NI, 128), 32)
    upcast = interp or a.dtype != g.dtype
    grid = (cdiv(NO, bo), cdiv(NI, bi))
    _wgrad_kernel[grid](a, g, w, K, NI, NO, a.stride(0), a.stride(1), g.stride(0), g.stride(1),
                        w.stride(0), w.stride(1), UPCAST=upcast,
                        IEEE=a.dtype == torch.float32 or upcast,
                        BLOCK_O=bo, BLOCK_I=bi, BLOCK_K=bk, num_warps=4 if interp else 8)
