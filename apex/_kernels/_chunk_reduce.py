"""Deterministic per-tensor reductions of per-chunk partial results (no atomics).

Multi-tensor kernels that need a per-tensor norm write one partial value per program (chunk) into a
``partials`` buffer of ``rows * n_chunks`` floats. :func:`reduce_rows` turns it into ``rows * n_tensors``
per-tensor results with one small launch: a program handles ``BLOCK_T`` tensors and walks their chunks in
order, so the result does not depend on scheduling.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt
from apex._kernels._host import cdiv

_BLOCK_T = 128


def chunk_first(tab: mt.TensorTable) -> torch.Tensor:
    """Device int64 tensor of each tensor's first chunk index (plus the total): the table's own, uploaded
    with its layout (no copy, and no host work per tensor, at a call)."""
    if tab.first is not None:
        return tab.first
    return mt._upload(tab.chunk_first, tab.ptrs.device)  # (a table made by hand, without its layout)


@triton.jit
def _reduce_kernel(partials, first, out, n_tensors, n_chunks, max_chunks, alpha, beta,
                   MAX: tl.constexpr, SQRT: tl.constexpr, BLEND: tl.constexpr, BLOCK_T: tl.constexpr):
    row = tl.program_id(1)
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = ts < n_tensors
    lo = tl.load(first + ts, mask=tm, other=0)
    hi = tl.load(first + ts + 1, mask=tm, other=0)
    acc = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in range(0, max_chunks):
        c = lo + j
        cm = tm & (c < hi)
        x = tl.load(partials + row * n_chunks + c, mask=cm, other=0.0)
        if MAX:
            acc = tl.maximum(acc, x)
        else:
            acc = acc + x
    if BLEND:
        # NovoGrad's running norm: L2 blends squares, the max-norm blends values.
        old = tl.load(out + row * n_tensors + ts, mask=tm, other=0.0)
        if MAX:
            acc = alpha * old + beta * acc
        else:
            acc = tl.sqrt_rn(alpha * old * old + beta * acc)
    elif SQRT:
        acc = tl.sqrt_rn(acc)  # IEEE: these norms feed LAMB's trust ratio and NovoGrad's update
    tl.store(out + row * n_tensors + ts, acc, mask=tm)


def reduce_rows(partials: torch.Tensor, tab: mt.TensorTable, out: torch.Tensor, rows: int, *,
                use_max: bool = False, sqrt: bool = True, blend: tuple[float, float] | None = None) -> None:
    """``out[r * T + t] = sqrt(sum of partials[r * C + c] over t's chunks)`` (or max; or a blend with
    ``out``'s old value: ``sqrt(a * old^2 + b * sum)`` / ``a * old + b * max``)."""
    alpha, beta = blend if blend is not None else (0.0, 1.0)
    grid = (cdiv(tab.n_tensors, _BLOCK_T), rows)
    _reduce_kernel[grid](partials, chunk_first(tab), out, tab.n_tensors, tab.n_chunks, tab.max_chunks, float(alpha),
                         float(beta), MAX=use_max, SQRT=sqrt, BLEND=blend is not None, BLOCK_T=_BLOCK_T)
