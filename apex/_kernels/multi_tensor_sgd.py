"""SGD (and ROCm's LARS) over lists of tensors: one launch per (device, dtypes) group, one pass.

Lists: grads, weights, momentum buffers, model copies (the last repeats the weights when there is no copy
and is then never touched). Bytes per fp32 element: 20 with momentum (g, w, buf read; w, buf written),
16 on the first step (the buffer is written, not read), 12 without momentum.

SGD on fp16/bf16 weights without a copy list (ROUND) rounds after every step of ``torch.optim.SGD``'s
sequence of operations, so that the update uses the stored momentum as PyTorch does (see
apex/ops/multi_tensor_sgd.py); fp32 weights and fp32 masters with copies keep one fp32 pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt
from apex._kernels._rounding import cast


@triton.jit
def _rounded(x, DT: tl.constexpr, ROUND: tl.constexpr):
    """``x`` rounded to ``DT`` and back to fp32 when ROUND (one PyTorch operation's stored result)."""
    if ROUND:
        return cast(x, DT).to(tl.float32)
    else:
        return x


@triton.jit
def _sgd_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors,
                noop_flag, grad_norms, param_norms,
                lr, wd, momentum, one_m_dampening, scale, trust_coefficient, eps,
                G_DT: tl.constexpr, W_DT: tl.constexpr, M_DT: tl.constexpr, C_DT: tl.constexpr,
                HAS_MOMENTUM: tl.constexpr, FIRST_RUN: tl.constexpr, NESTEROV: tl.constexpr,
                WD_AFTER: tl.constexpr, HAS_COPY: tl.constexpr, LARS: tl.constexpr, ROUND: tl.constexpr,
                ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr = 1):
    # (ALIGNED: the table's ``aligned``, 4-element vector accesses; see mt.tensor_ptr)
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    n = n * (tl.load(noop_flag) == 0).to(n.dtype)  # Apex skips the whole update when the flag is set
    g_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED)
    w_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, W_DT, ALIGNED)
    m_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, M_DT, ALIGNED)
    c_ptr = mt.tensor_ptr(ptrs, 3, n_tensors, t, C_DT, ALIGNED)
    if LARS:
        # Layer-wise rate: lr * tc * ‖w‖ / (‖g‖ + wd ‖w‖ + eps), or lr when either norm is zero.
        g_norm = tl.load(grad_norms + t)
        w_norm = tl.load(param_norms + t)
        ok = (g_norm > 0.0) & (w_norm > 0.0)
        denom = tl.where(ok, g_norm + w_norm * wd + eps, 1.0)
        ratio = tl.where(ok, tl.div_rn(trust_coefficient * w_norm, denom), 1.0)  # IEEE, as PyTorch
        lr = lr * ratio
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32) * scale
        w = tl.load(w_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        g = _rounded(g, G_DT, ROUND)
        if not WD_AFTER:
            g = _rounded(g + wd * w, W_DT, ROUND)
        if LARS:
            # ROCm's convention: the buffer holds the (negative) step, w += buf.
            if HAS_MOMENTUM:
                if FIRST_RUN:
                    buf = -lr * g
                else:
                    buf = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                    buf = momentum * buf - lr * one_m_dampening * g
                tl.store(m_ptr + idx, cast(buf, M_DT), mask=mask)
                if NESTEROV:
                    upd = momentum * buf - lr * g
                else:
                    upd = buf
            else:
                upd = -lr * g
            if WD_AFTER:
                upd = upd - lr * wd * w
            w = w + upd
        else:
            if HAS_MOMENTUM:
                if FIRST_RUN:
                    buf = g
                else:
                    buf = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                    buf = _rounded(_rounded(buf * momentum, M_DT, ROUND) + one_m_dampening * g, M_DT, ROUND)
                tl.store(m_ptr + idx, cast(buf, M_DT), mask=mask)
                if NESTEROV:
                    g = _rounded(g + momentum * buf, W_DT, ROUND)
                else:
                    g = buf
            if WD_AFTER:
                g = _rounded(g + wd * w, W_DT, ROUND)
            w = w + (-lr * g)
        tl.store(w_ptr + idx, cast(w, W_DT), mask=mask)
        if HAS_COPY:
            tl.store(c_ptr + idx, cast(w, C_DT), mask=mask)


# Its name in apex._kernels._tuning (the sweep's, the measured table's): every element independent, a chunk
# may be split over several programs (mt.parts).
OP = "multi_tensor_sgd"


def sgd(noop_flag, lists, *, lr, wd, momentum, dampening, nesterov, first_run, wd_after_momentum, scale,
        grad_norms=None, param_norms=None, trust_coefficient=0.0, eps=0.0, lars=False) -> None:
    has_copy = len(lists) == 4
    full = lists if has_copy else lists + [lists[1]]
    n = len(full[0])
    for indices, sub in mt.group(full):
        w_dtype = sub[1].dtype if sub[1].dtype is not None else sub[1][0].dtype
        rounded = not (lars or has_copy or w_dtype == torch.float32)
        if lars and len(indices) == n:  # one group of every tensor: the norms as they are
            gn, pn = grad_norms, param_norms
        elif lars:  # this group's tensors' norms, in order (gathered with an index uploaded once)
            at = mt.index_on(indices, grad_norms.device)
            gn, pn = grad_norms.index_select(0, at), param_norms.index_select(0, at)
        else:
            gn = pn = noop_flag
        tab = mt.table(sub)
        mt.launch(_sgd_kernel, tab, noop_flag, gn, pn,
                  # 1 - dampening in double: from an fp32 dampening of 0.9 it would be 2.4e-7 off
                  float(lr), float(wd), float(momentum), 1.0 - float(dampening), float(scale),
                  float(trust_coefficient), float(eps),
                  options=(momentum != 0, bool(first_run), bool(nesterov), bool(wd_after_momentum), has_copy,
                           bool(lars), rounded, tab.aligned), op=OP, default_parts=1)


def tables(lists) -> list:
    """The tables of the SGD launches over ``lists`` (``[g, w, momenta]`` or with model copies), one per
    (device, dtypes) group: what :func:`run` launches over. An optimizer keeps them while its tensors'
    addresses repeat."""
    full = lists if len(lists) == 4 else lists + [lists[1]]
    return [mt.table(sub) for _, sub in mt.group(full)]


def run(tabs: list, has_copy: bool, noop_flag, *, lr, wd, momentum, dampening, nesterov, first_run,
        wd_after_momentum, scale) -> None:
    """:func:`sgd` without LARS over the :func:`tables` of its lists (``has_copy``: they had model copies)."""
    args = (noop_flag, noop_flag, noop_flag, float(lr), float(wd), float(momentum), 1.0 - float(dampening),
            float(scale), 0.0, 0.0)
    flags = (momentum != 0, bool(first_run), bool(nesterov), bool(wd_after_momentum), has_copy, False)
    for tab in tabs:
        rounded = not has_copy and tab.dtypes[1] != tl.float32  # (as sgd: fp16/bf16 weights without masters)
        programs, parts, _, block, warps = mt.parts(OP, tab, default_parts=1)  # (mt.launch's, inline)
        _sgd_kernel[(programs,)](tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
                                 *args, *tab.dtypes, *flags, rounded, tab.aligned, tab.chunk, block, parts,
                                 num_warps=warps)
