"""The one-pass LayerNorm / RMSNorm kernels (``apex._kernels._norm`` plans and launches them; its docstring
says what each computes): the forward over tiles of ``BLOCK_M`` rows with the statistics in fp32, the backward
writing per-program partial sums of the parameters' gradients, and the fixed-order reduction of those partials.
"""

from __future__ import annotations

import triton
import triton.language as tl

from apex._kernels._norm_wide import _chunk_params, _xhat


@triton.jit
def _row_tile(pid, t, tiles_per_prog, M, cmask, BLOCK_M: tl.constexpr):
    """Rows of the ``t``-th tile of program ``pid`` (programs own consecutive tiles), their mask, their
    int64 offsets (no overflow on large inputs) and the 2-D mask with the column mask ``cmask``."""
    rows = (pid * tiles_per_prog + t) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    return rows, rmask, rows64, mask


@triton.jit
def _rstd(var, eps):
    """``1 / sqrt(var + eps)`` correctly rounded: one per row, so the IEEE forms cost nothing (``tl.rsqrt``
    and ``1 / tl.sqrt`` are ``rsqrt.approx`` / ``sqrt.approx`` and ``div.full`` on NVIDIA GPUs)."""
    return tl.div_rn(1.0, tl.sqrt_rn(var + eps))


@triton.jit
def _fwd_kernel(X, R, H, Y, W, B, Mean, Rstd, M, N, stride_x, stride_r, eps, tiles_per_prog,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, W_PER_TILE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    if not W_PER_TILE:
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_B:
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    for t in range(0, tiles_per_prog):
        rows, rmask, rows64, mask = _row_tile(pid, t, tiles_per_prog, M, cmask, BLOCK_M)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(R + rows64[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = (x + r).to(H.dtype.element_ty)
            tl.store(H + rows64[:, None] * N + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        if IS_RMS:
            var = tl.div_rn(tl.sum(x * x, axis=1), N * 1.0)
            rstd = _rstd(var, eps)
            xhat = x * rstd[:, None]
        else:
            mean = tl.div_rn(tl.sum(x, axis=1), N * 1.0)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            var = tl.div_rn(tl.sum(xc * xc, axis=1), N * 1.0)
            rstd = _rstd(var, eps)
            xhat = xc * rstd[:, None]
            tl.store(Mean + rows, mean, mask=rmask)
        tl.store(Rstd + rows, rstd, mask=rmask)
        if W_PER_TILE:
            # Wide rows: the parameters read (from L1/L2) after the row's reductions, live only for the
            # affine step, instead of held in fp32 registers across the whole pass.
            if HAS_W:
                w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            if HAS_B:
                b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        y = xhat
        if HAS_W:
            y = y * w[None, :]
        if HAS_B:
            y = y + b[None, :]
        tl.store(Y + rows64[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_kernel(DY, V, W, B, Mean, Rstd, DR, DX, DWp, DBp, M, N, stride_dy, stride_v, stride_dr,
                tiles_per_prog, eps,
                IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, MEM_EFF: tl.constexpr,
                HAS_DR: tl.constexpr, ONE_DIRECTION: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, W_PER_TILE: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    dw_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    db_acc = tl.full([BLOCK_N], 0.0, tl.float32)
    # The weight held across passes unless W_PER_TILE; the bias only to undo the affine transform (MEM_EFF).
    w, b = _chunk_params(W, B, cols, cmask, HAS_W and not W_PER_TILE, HAS_B, MEM_EFF)
    for t in range(0, tiles_per_prog):
        rows, rmask, rows64, mask = _row_tile(pid, t, tiles_per_prog, M, cmask, BLOCK_M)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + rows64[:, None] * stride_v + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
        if HAS_W:
            if W_PER_TILE:  # wide rows: the weight from L1/L2 each pass frees its registers
                w = tl.load(W + cols, mask=cmask, other=1.0).to(tl.float32)
        mean = rstd  # (a placeholder where unused)
        if not IS_RMS:
            if not MEM_EFF:
                mean = tl.load(Mean + rows, mask=rmask, other=0.0)
        xhat = _xhat(v, w, b, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, MEM_EFF)
        # The dw/db sums first: dy is then dead once w·dy is formed, and what stays live across the row's
        # reductions is x̂ and w·dy (at 16 elements a thread, 96 registers instead of 106 for RMSNorm).
        if HAS_W:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if HAS_B:
            db_acc += tl.sum(dy, axis=0)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        if ONE_DIRECTION:
            # Rows with one direction left to vary in (RMSNorm of one element, LayerNorm of two): dx is
            # (centred) w·dy times (1 − mean(x̂²))·rstd, and 1 − mean(x̂²) = eps·rstd² exactly. The general
            # form below reaches it by cancelling terms equal to within eps/var, which leaves about
            # log10(var/eps) digits fewer than fp32 has (all of them at var/eps ~ 1e7).
            if IS_RMS:
                dx = wdy * (eps * rstd * rstd * rstd)[:, None]
            else:
                c2 = tl.div_rn(tl.sum(wdy, axis=1), N * 1.0)
                # One element: nothing varies, dx is 0. Not w·dy − c2 there: a GPU contracts it into
                # fma(dy, w, −c2), whose unrounded product leaves the product's rounding error (~1e-7·|w·dy|).
                dx = tl.where(mask & (N > 1), wdy - c2[:, None], 0.0) * (eps * rstd * rstd * rstd)[:, None]
        else:
            c1 = tl.div_rn(tl.sum(xhat * wdy, axis=1), N * 1.0)
            if IS_RMS:
                dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            else:
                c2 = tl.div_rn(tl.sum(wdy, axis=1), N * 1.0)
                dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DR:
            dr = tl.load(DR + rows64[:, None] * stride_dr + cols[None, :], mask=mask, other=0.0)
            dx += dr.to(tl.float32)
        tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DWp + pid * N + cols, dw_acc, mask=cmask)
    if HAS_B:
        tl.store(DBp + pid * N + cols, db_acc, mask=cmask)


@triton.jit
def _reduce_kernel(DWp, DBp, DW, DB, P, N, HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Column sums of the ``P × N`` partials, in a fixed order."""
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc_w = tl.full([BLOCK_N], 0.0, tl.float32)
    acc_b = tl.full([BLOCK_N], 0.0, tl.float32)
    for p0 in range(0, P, BLOCK_P):
        prow = p0 + tl.arange(0, BLOCK_P)
        mask = (prow < P)[:, None] & cmask[None, :]
        offs = prow[:, None].to(tl.int64) * N + cols[None, :]
        acc_w += tl.sum(tl.load(DWp + offs, mask=mask, other=0.0), axis=0)
        if HAS_B:
            acc_b += tl.sum(tl.load(DBp + offs, mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, acc_w.to(DW.dtype.element_ty), mask=cmask)
    if HAS_B:
        tl.store(DB + cols, acc_b.to(DB.dtype.element_ty), mask=cmask)
