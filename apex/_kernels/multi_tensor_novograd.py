"""NovoGrad over lists of tensors: per-tensor gradient norms blended into a running norm, then the update.

Per (device, dtype) group: one launch writes per-chunk partial norms of the gradients (sum of squares, or
max |g|), one small launch reduces them per tensor and blends them into the running norms in place (one
writer per tensor, so no race), one launch reads g, p, m and writes p, m. Math in IEEE fp32
(``tl.div_rn``; ``/`` is approximate on NVIDIA GPUs); ``beta3`` (``1 - beta1``) comes from the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt
from apex._kernels._chunk_reduce import reduce_rows


@triton.jit
def _norm_partials_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, partials, noop_flag,
                          G_DT: tl.constexpr, MAX: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED)
    g_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if MAX:
            acc = tl.maximum(acc, tl.abs(g))
        else:
            acc += g * g
    if MAX:
        total = tl.max(acc, axis=0)
    else:
        total = tl.sum(acc, axis=0)
    bad = mt.nonfinite(total)
    tl.store(noop_flag, bad.to(tl.int32), mask=bad)
    tl.store(partials + tl.program_id(0), total)


@triton.jit
def _update_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, norms,
                   lr, beta1, beta3, bc1, bc2, eps, decay,
                   G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, REG_INSIDE: tl.constexpr,
                   ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr = 1):
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    denom = tl.div_rn(tl.load(norms + t), bc2) + eps
    g_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED)
    p_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, P_DT, ALIGNED)
    m_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, M_DT, ALIGNED)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if REG_INSIDE:
            g = tl.div_rn(g, denom) + decay * p
            m = beta1 * m + beta3 * g
            p = p - lr * tl.div_rn(m, bc1)
        else:
            m = beta1 * m + beta3 * g
            p = p - lr * (tl.div_rn(tl.div_rn(m, bc1), denom) + decay * p)
        tl.store(p_ptr + idx, p.to(P_DT), mask=mask)
        tl.store(m_ptr + idx, m.to(M_DT), mask=mask)


# The update's name in apex._kernels._tuning: element-wise, so mt.parts may split a chunk over programs (the
# norm pass writes one partial sum a program, indexed by program id: one program a chunk).
OP = "multi_tensor_novograd.update"


def blend_norms(noop_flag: torch.Tensor, tab: mt.TensorTable, norms: torch.Tensor, alpha: float, beta: float,
                max_norm: bool) -> None:
    """``norms[i] = sqrt(alpha * norms[i]^2 + beta * ‖g_i‖^2)`` (or ``alpha * norms[i] + beta * max|g_i|``)
    for the gradients in list 0 of ``tab`` (the update's table of one (device, dtype) group, every tensor
    non-empty: new gradients cost one table for both launches)."""
    partials = torch.empty(tab.n_chunks, dtype=torch.float32, device=tab.ptrs.device)
    mt.launch_with_dtypes(_norm_partials_kernel, tab, tab.dtypes[:1], partials, noop_flag,
                          # (the whole table's flag: reading list 0 alone would allow vectors more often,
                          # but a table keeps no flag of list 0 apart)
                          options=(bool(max_norm), tab.aligned))
    reduce_rows(partials, tab, norms, 1, use_max=bool(max_norm), blend=(alpha, beta))


def update(tab: mt.TensorTable, norms: torch.Tensor, *, lr: float, beta1: float, beta3: float, bc1: float,
           bc2: float, eps: float, weight_decay: float, reg_inside_moment: bool) -> None:
    """The NovoGrad update of one (device, dtype) group (``tab``: its table of ``[g, p, m]``) with its
    running norms ``norms``."""
    mt.launch(_update_kernel, tab, norms, float(lr), float(beta1), float(beta3), float(bc1), float(bc2),
              float(eps), float(weight_decay), options=(bool(reg_inside_moment), tab.aligned), op=OP)
