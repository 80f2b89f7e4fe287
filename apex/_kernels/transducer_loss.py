"""Triton kernels of the RNN-T loss: the alpha/beta recursion as an anti-diagonal wavefront, and the gradient.

``_alpha_beta``: one program per batch element (all of them in one program under the interpreter) walks
the D = f_len + y_len anti-diagonals of its (t, u) lattice; step k computes alpha on diagonal k and beta on
diagonal D − 1 − k, all cells of a diagonal at once (a vector over u). Every cell depends only on the
previous diagonal, which the program has stored and re-reads after a barrier. Log-probabilities
(``x − lse``, the logits minus their row log-sum-exp) are gathered straight from ``x`` (blank and the label
of each cell), dense (B, T, U, V) or packed (rows, V).

``_grad``: each program takes a few rows of ``x`` and streams the vocabulary once and writes the gradient:
``lg·(exp(lp_v + α + β − log Z) − [v = blank]·exp(α + lp_blank + β(t+1, u) − log Z)
− [v = label]·exp(α + lp_label + β(t, u+1) − log Z))`` with the softmax backward fused in, or only the two
sparse terms (the gradient with respect to the log-probabilities) otherwise; zero outside the lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _lae(a, b):
    # log(exp(a) + exp(b)), -inf when both are -inf
    m = tl.maximum(a, b)
    safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.exp(a - safe) + tl.exp(b - safe)
    return tl.where(m == float("-inf"), m, safe + tl.log(tl.where(m == float("-inf"), 1.0, total)))


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_lae)


@triton.jit
def _row(b, t, u, T, U, y_len, offset, PACKED: tl.constexpr):
    if PACKED:
        return offset + t * (y_len + 1) + u
    return (b * T + t).to(tl.int64) * U + u


@triton.jit
def _alpha_beta(lp_ptr, lse_ptr, lab_ptr, flen_ptr, ylen_ptr, boff_ptr, alpha_ptr, beta_ptr, loss_ptr, B, T, U, TX,
                UX, V, L, lab_stride, blank, PACKED: tl.constexpr, BB: tl.constexpr, BLOCK_U: tl.constexpr):
    # BB batch elements per program (1 on GPUs; all of them under the interpreter), a [BB, BLOCK_U] tile of
    # one anti-diagonal per step.
    # Index arithmetic in int64 throughout (no overflow on large inputs, no overflow checks in the interpreter).
    b = (tl.program_id(0).to(tl.int64) * BB + tl.arange(0, BB))[:, None]
    bm = b < B
    f_len = tl.load(flen_ptr + b, mask=bm, other=0).to(tl.int64)
    y_len = tl.load(ylen_ptr + b, mask=bm, other=-1).to(tl.int64)
    offset = 0
    if PACKED:
        offset = tl.load(boff_ptr + b - 1, mask=bm & (b > 0), other=0)
    u = tl.arange(0, BLOCK_U).to(tl.int64)[None, :]
    # The range checks, here rather than on the host (a host read is a GPU synchronisation per call): an entry
    # whose lengths or used labels are out of range ("bad") walks an empty lattice, so nothing out of bounds
    # is read or written; it gets a NaN loss, -inf alpha and beta (alpha(0, 0) = -inf marks it for _grad,
    # which gives it a zero gradient).
    bad = bm & ((f_len < 1) | (f_len > T) | (y_len < 0) | (y_len > U - 1) | (y_len > L))
    lab = tl.load(lab_ptr + b * lab_stride + u, mask=(u < y_len) & ~bad, other=0).to(tl.int64)
    bad = bad | (tl.max(((lab < 0) | (lab >= V)).to(tl.int32), 1)[:, None] > 0)
    f_len = tl.where(bad, 0, f_len)
    y_len = tl.where(bad, 0, y_len)
    base = b * T * U
    acc_ty = alpha_ptr.dtype.element_ty
    # Cells outside the lengths hold -inf (the buffers come uninitialised): the recursion below never writes
    # them, so no ordering with its stores is needed, and it never reads them.
    for t0 in range(0, T):
        outside = bm & (u < U) & ((t0 >= f_len) | (u > y_len))
        tl.store(alpha_ptr + base + t0 * U + u, float("-inf"), mask=outside)
        tl.store(beta_ptr + base + t0 * U + u, float("-inf"), mask=outside)
    n_diag = f_len + y_len
    for k in range(0, tl.max(n_diag)):
        # alpha on diagonal k: alpha(t, u) = lae(alpha(t-1, u) + blank(t-1, u), alpha(t, u-1) + label(t, u-1))
        t = k - u
        ok = (t >= 0) & (t < f_len) & (u <= y_len)
        up = ok & (t >= 1)
        left = ok & (u >= 1)
        a_up = tl.load(alpha_ptr + base + (t - 1) * U + u, mask=up, other=float("-inf"))
        r_up = _row(b, t - 1, u, TX, UX, y_len, offset, PACKED)
        lp_up = tl.load(lp_ptr + r_up * V + blank, mask=up, other=float("-inf")).to(acc_ty)
        lp_up -= tl.load(lse_ptr + r_up, mask=up, other=0.0)
        a_left = tl.load(alpha_ptr + base + t * U + u - 1, mask=left, other=float("-inf"))
        lab_left = tl.load(lab_ptr + b * lab_stride + u - 1, mask=left, other=0)
        r_left = _row(b, t, u - 1, TX, UX, y_len, offset, PACKED)
        lp_left = tl.load(lp_ptr + r_left * V + lab_left, mask=left, other=float("-inf")).to(acc_ty)
        lp_left -= tl.load(lse_ptr + r_left, mask=left, other=0.0)
        a = _lae(a_up + lp_up, a_left + lp_left)
        a = tl.where((t == 0) & (u == 0), 0.0, a)
        tl.store(alpha_ptr + base + t * U + u, a, mask=ok)
        # beta on diagonal D-1-k: beta(t, u) = lae(beta(t+1, u) + blank(t, u), beta(t, u+1) + label(t, u))
        t = n_diag - 1 - k - u
        ok = (t >= 0) & (t < f_len) & (u <= y_len)
        row = _row(b, t, u, TX, UX, y_len, offset, PACKED)
        lp_b = tl.load(lp_ptr + row * V + blank, mask=ok, other=float("-inf")).to(acc_ty)
        lp_l = tl.load(lp_ptr + row * V + lab, mask=ok & (u < y_len), other=float("-inf")).to(acc_ty)
        lse = tl.load(lse_ptr + row, mask=ok, other=0.0)
        lp_b -= lse
        lp_l -= lse
        b_down = tl.load(beta_ptr + base + (t + 1) * U + u, mask=ok & (t + 1 < f_len), other=float("-inf"))
        b_down = tl.where((t == f_len - 1) & (u == y_len), 0.0, b_down)  # the final blank ends the path
        b_right = tl.load(beta_ptr + base + t * U + u + 1, mask=ok & (u < y_len), other=float("-inf"))
        tl.store(beta_ptr + base + t * U + u, _lae(b_down + lp_b, b_right + lp_l), mask=ok)
        tl.debug_barrier()
    z = tl.load(beta_ptr + base, mask=bm, other=0.0)
    tl.store(loss_ptr + b, tl.where(bad, float("nan"), -z).to(loss_ptr.dtype.element_ty), mask=bm)


@triton.jit
def _grad(lp_ptr, lse_ptr, lab_ptr, flen_ptr, ylen_ptr, boff_ptr, rowb_ptr, alpha_ptr, beta_ptr, lg_ptr, out_ptr,
          R, T, U, TX, UX, V, lab_stride, blank, PACKED: tl.constexpr, FUSED: tl.constexpr,
          ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    # ROWS rows per program; every per-row quantity is a [ROWS] vector, the vocabulary a [ROWS, BLOCK_V] tile.
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = row < R
    if PACKED:
        b = tl.load(rowb_ptr + row, mask=rm, other=0).to(tl.int64)
        y_len = tl.load(ylen_ptr + b).to(tl.int64)
        local = row - tl.load(boff_ptr + b - 1, mask=b > 0, other=0)
        t = local // (y_len + 1)
        u = local % (y_len + 1)
    else:
        b = tl.where(rm, row // (TX * UX), 0)
        t = (row // UX) % TX
        u = row % UX
        y_len = tl.load(ylen_ptr + b).to(tl.int64)
    f_len = tl.load(flen_ptr + b).to(tl.int64)
    base = b * T * U
    # alpha(0, 0) is 0 for every entry in range and -inf for one that _alpha_beta found out of range: those
    # rows get a zero gradient and read nothing (their lengths may point past the lattice, their labels past V).
    valid = rm & (tl.load(alpha_ptr + base) == 0.0) & (t < f_len) & (u <= y_len)
    emits = valid & (u < y_len)
    acc_ty = alpha_ptr.dtype.element_ty
    lab = tl.load(lab_ptr + b * lab_stride + u, mask=emits, other=-1)
    log_z = tl.load(beta_ptr + base)
    lg = tl.load(lg_ptr + b).to(acc_ty)
    a = tl.load(alpha_ptr + base + t * U + u, mask=valid, other=float("-inf"))
    beta = tl.load(beta_ptr + base + t * U + u, mask=valid, other=float("-inf"))
    b_down = tl.load(beta_ptr + base + (t + 1) * U + u, mask=valid & (t + 1 < f_len), other=float("-inf"))
    b_down = tl.where((t == f_len - 1) & (u == y_len), 0.0, b_down)
    b_right = tl.load(beta_ptr + base + t * U + u + 1, mask=emits, other=float("-inf"))
    lse = tl.load(lse_ptr + row, mask=valid, other=0.0)
    lp_b = tl.load(lp_ptr + row * V + blank, mask=valid, other=0.0).to(acc_ty) - lse
    lp_l = tl.load(lp_ptr + row * V + lab, mask=emits, other=0.0).to(acc_ty) - lse
    c_blank = tl.where(valid, lg * tl.exp(a + lp_b + b_down - log_z), 0.0)[:, None]
    c_label = tl.where(emits, lg * tl.exp(a + lp_l + b_right - log_z), 0.0)[:, None]
    c_all = tl.where(valid, lg * tl.exp(a + beta - log_z), 0.0)[:, None]
    for v0 in range(0, V, BLOCK_V):
        v = (v0 + tl.arange(0, BLOCK_V))[None, :]
        g = -tl.where(v == blank, c_blank, 0.0) - tl.where(v == lab[:, None], c_label, 0.0)
        offs = row[:, None] * V + v
        if FUSED:
            lp = tl.load(lp_ptr + offs, mask=valid[:, None] & (v < V), other=float("-inf")).to(acc_ty)
            g += tl.exp(lp - lse[:, None]) * c_all
        tl.store(out_ptr + offs, g.to(out_ptr.dtype.element_ty), mask=rm[:, None] & (v < V))


@triton.jit
def _row_lse(x_ptr, lse_ptr, R, V, ROWS: tl.constexpr, BLOCK_V: tl.constexpr):
    # One pass of online log-sum-exp over ROWS rows, in fp32 (fp64 for fp64 rows).
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rm = row < R
    acc_ty = lse_ptr.dtype.element_ty
    m = tl.full([ROWS, BLOCK_V], float("-inf"), acc_ty)
    s = tl.zeros([ROWS, BLOCK_V], acc_ty)
    for v0 in range(0, V, BLOCK_V):
        v = (v0 + tl.arange(0, BLOCK_V))[None, :]
        x = tl.load(x_ptr + row[:, None] * V + v, mask=rm[:, None] & (v < V), other=float("-inf")).to(acc_ty)
        m_new = tl.maximum(m, x)
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.exp(x - safe)
        m = m_new
    mx = tl.max(m, 1)
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.sum(s * tl.exp(m - safe[:, None]), 1)
    tl.store(lse_ptr + row, safe + tl.log(tot), mask=rm)


def _block_v(V: int) -> int:
    return min(1024, next_power_of_2(max(V, 16)))


def _rows_per_program(rows: int, block_v: int) -> int:
    # About 4K elements per tile; under the interpreter, where each program costs a fixed overhead, at most
    # ~16 programs.
    per = max(1, 4096 // block_v)
    if _INTERP:
        per = max(per, cdiv(rows, 16))
    return next_power_of_2(min(per, max(rows, 1)))


# Launch plans by size (the row-wise kernels' grid, rows a program and vocabulary block; the alpha/beta
# kernel's grid, batch elements a program and lattice block): a call of a shape seen before looks them up.
_ROW_PLANS = _tuning.plan_cache()
_LATTICE_PLANS = _tuning.plan_cache()


def _row_plan(rows: int, V: int) -> tuple:
    plan = _ROW_PLANS.get((rows, V))
    if plan is None:
        bv = _block_v(V)
        per = _rows_per_program(rows, bv)
        plan = _ROW_PLANS[(rows, V)] = ((cdiv(rows, per),), per, bv)
    return plan


def row_lse(x, acc_dtype: torch.dtype):
    """log-sum-exp of every row of the contiguous ``x`` (rows, V) in ``acc_dtype``."""
    V = x.shape[-1]
    rows = x.numel() // max(V, 1)
    lse = torch.empty(*x.shape[:-1], dtype=acc_dtype, device=x.device)  # (integer sizes: a Size costs ~2 µs more)
    if rows:
        grid, per, bv = _row_plan(rows, V)
        _row_lse[grid](x, lse, rows, V, ROWS=per, BLOCK_V=bv)
    return lse


def forward_dense(x, label, f_len, y_len, sizes: tuple, blank_idx: int, acc_dtype: torch.dtype | None):
    """``(loss, lse, alpha, beta)`` of dense logits: :func:`row_lse`, then :func:`alpha_beta`, on the
    contiguous ``x`` of ``sizes`` (B, T, U, V, L) read once by the caller, the contiguous ``label`` (B, L) and
    int32 lengths on its device; ``acc_dtype`` None for ``x``'s own. The loss comes in ``x``'s dtype (the
    kernel rounds it once: no cast)."""
    B, T, U, V, L = sizes
    if acc_dtype is None:  # (x's own dtype and device: new_empty skips parsing both, ~2 µs an allocation)
        lse, alpha, beta = x.new_empty(B, T, U), x.new_empty(B, T, U), x.new_empty(B, T, U)
    else:
        dev = x.device
        lse = torch.empty(B, T, U, dtype=acc_dtype, device=dev)
        alpha = torch.empty(B, T, U, dtype=acc_dtype, device=dev)
        beta = torch.empty(B, T, U, dtype=acc_dtype, device=dev)
    loss = x.new_empty(B)
    rows = B * T * U
    grid, per, bv = _row_plan(rows, V)
    _row_lse[grid](x, lse, rows, V, per, bv)  # ROWS, BLOCK_V
    plan = _LATTICE_PLANS.get((B, U))
    if plan is None:
        plan = _lattice_plan(B, U)
    grid, bb, block_u = plan
    # (label contiguous: L is also its row stride)
    _alpha_beta[grid](x, lse, label, f_len, y_len, f_len, alpha, beta, loss, B, T, U, T, U, V, L, L, blank_idx,
                      False, bb, block_u)  # PACKED, BB, BLOCK_U
    return loss, lse, alpha, beta


def _lattice_plan(B: int, U: int) -> tuple:
    bb = next_power_of_2(B) if _INTERP else 1
    plan = _LATTICE_PLANS[(B, U)] = ((cdiv(B, bb),), bb, next_power_of_2(max(U, 2)))
    return plan


def alpha_beta(logp, lse, label, f_len, y_len, batch_offset, T: int, U: int, blank_idx: int, packed: bool,
               acc_dtype: torch.dtype):
    """``(alpha, beta, loss)`` of logits ``logp`` with row log-sum-exps ``lse`` (zeros for log-probabilities):
    (B, T, U) lattices in ``acc_dtype`` (−inf outside the lengths), loss (B,)."""
    B = f_len.shape[0]
    V = logp.shape[-1]
    dev = logp.device
    # (the kernel writes -inf outside the lengths itself: no fill here)
    alpha = torch.empty(B, T, U, dtype=acc_dtype, device=dev)
    beta = torch.empty(B, T, U, dtype=acc_dtype, device=dev)
    loss = torch.empty(B, dtype=acc_dtype, device=dev)
    tx, ux = (1, 1) if packed else (logp.shape[1], logp.shape[2])
    boff = batch_offset if packed else f_len
    if B:
        plan = _LATTICE_PLANS.get((B, U))
        if plan is None:
            plan = _lattice_plan(B, U)
        grid, bb, block_u = plan
        _alpha_beta[grid](logp, lse, label, f_len, y_len, boff, alpha, beta, loss, B, T, U, tx, ux, V,
                          label.shape[1], label.stride(0), blank_idx, packed, bb, block_u)  # PACKED, BB, BLOCK_U
    return alpha, beta, loss


def grad_dense(x, lse, loss_grad, alpha, beta, label, f_len, y_len, B: int, T: int, U: int, V: int, L: int,
               blank_idx: int):
    """:func:`grad` of :func:`forward_dense`'s call (fused, in ``x``'s dtype), its sizes passed as integers."""
    out = x.new_empty(B, T, U, V)
    rows = B * T * U
    grid, per, bv = _row_plan(rows, V)
    _grad[grid](x, lse, label, f_len, y_len, f_len, f_len, alpha, beta, loss_grad, out, rows, T, U, T, U, V, L,
                blank_idx, False, True, per, bv)  # PACKED, FUSED, ROWS, BLOCK_V
    return out


def grad(logp, lse, loss_grad, alpha, beta, label, f_len, y_len, batch_offset, row_batch, blank_idx: int,
         packed: bool, fused: bool, out_dtype: torch.dtype):
    """Gradient with respect to the logits (``fused``) or the log-probabilities, shaped like ``logp``."""
    B, T, U = alpha.shape
    V = logp.shape[-1]
    rows = logp.numel() // max(V, 1)
    out = torch.empty_like(logp, dtype=out_dtype, memory_format=torch.contiguous_format)
    tx, ux = (1, 1) if packed else (logp.shape[1], logp.shape[2])
    boff = batch_offset if packed else f_len
    rowb = row_batch if packed else f_len
    if rows:
        grid, per, bv = _row_plan(rows, V)
        _grad[grid](logp, lse, label, f_len, y_len, boff, rowb, alpha, beta, loss_grad, out, rows, T, U, tx, ux, V,
                    label.stride(0), blank_idx, PACKED=packed, FUSED=fused, ROWS=per, BLOCK_V=bv)
    return out
