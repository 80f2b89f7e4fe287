"""LayerNorm / RMSNorm backward for wide rows, in column chunks (``_norm``'s plans pick it: ``"split"``).

The one-pass backward (``_norm._bwd_kernel``) holds a whole row, and its columns' dw/db sums, in registers:
from 32 elements a thread (16,384 columns on 16 warps) its sm_90 code spills and one program fills an SM.
Here no program holds more than a ``BLOCK_M x BLOCK_N`` tile:

1. :func:`_bwd_stats_kernel`: per row, ``c1 = mean(x̂·w·dy)`` and ``c2 = mean(w·dy)`` (RMSNorm: ``c1``
   alone), summed in fp32 over the row's column chunks;
2. :func:`_bwd_split_kernel`: programs of one group of rows by one column chunk; each walks its rows and
   writes ``dx = rstd·(w·dy − x̂·c1 − c2)`` (RMSNorm without ``c2``; plus the residual gradient), and its
   chunk's partial ``Σ dy·x̂`` and ``Σ dy`` over its rows, which ``_norm._reduce_kernel`` sums in a fixed
   order.

dy and the saved tensor are read twice (5 row-sized transfers with dx instead of 3), for many small programs
per SM and no spills. The numerics are the one-pass kernel's: fp32 statistics and sums, ``tl.div_rn`` means,
the same ``x̂`` and ``dx`` expressions, one rounding to the output dtype, a fixed order of every sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _xhat(v, w, b, mean, rstd, mask, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
          MEM_EFF: tl.constexpr):
    """x̂ of a tile (this module's kernels' and the one-pass ``_norm._bwd_kernel``'s): from the saved output
    (``MEM_EFF``: the affine transform undone with the chunk's ``w``, ``b``), else from the saved input and
    the rows' ``mean`` (LayerNorm) and ``rstd``; 0 outside ``mask``. Arguments a configuration does not use
    are placeholders."""
    if MEM_EFF:
        xhat = v
        if HAS_B:
            xhat = xhat - b[None, :]
        if HAS_W:
            xhat = xhat / w[None, :]
    else:
        if IS_RMS:
            xhat = v * rstd[:, None]
        else:
            xhat = (v - mean[:, None]) * rstd[:, None]
    return tl.where(mask, xhat, 0.0)


@triton.jit
def _chunk_params(W, B, cols, cmask, HAS_W: tl.constexpr, HAS_B: tl.constexpr, MEM_EFF: tl.constexpr):
    """The weight and (memory-efficient only: it undoes the affine transform) bias of columns ``cols`` in fp32,
    ones where a configuration does not use them (placeholders for :func:`_xhat`)."""
    w = tl.full(cols.shape, 1.0, tl.float32)
    b = w
    if HAS_W:
        w = tl.load(W + cols, mask=cmask, other=1.0).to(tl.float32)
    if MEM_EFF:
        if HAS_B:
            b = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _bwd_stats_kernel(DY, V, W, B, Mean, Rstd, C, M, N, stride_dy, stride_v,
                      IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, MEM_EFF: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``C[0, row] = mean(x̂·w·dy)`` and (LayerNorm) ``C[1, row] = mean(w·dy)`` of ``BLOCK_M`` rows."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
    mean = rstd  # (a placeholder where unused)
    if not IS_RMS:
        if not MEM_EFF:
            mean = tl.load(Mean + rows, mask=rmask, other=0.0)
    # Element-wise sums over the chunks, reduced once at the end: no cross-thread reduction per chunk.
    acc1 = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    acc2 = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for c0 in range(0, N, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + rows64[:, None] * stride_v + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w, b = _chunk_params(W, B, cols, cmask, HAS_W, HAS_B, MEM_EFF)
        xhat = _xhat(v, w, b, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, MEM_EFF)
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        acc1 += xhat * wdy
        if not IS_RMS:
            acc2 += wdy
    tl.store(C + rows, tl.div_rn(tl.sum(acc1, axis=1), N * 1.0), mask=rmask)
    if not IS_RMS:
        tl.store(C + M + rows, tl.div_rn(tl.sum(acc2, axis=1), N * 1.0), mask=rmask)


@triton.jit
def _bwd_split_kernel(DY, V, W, B, Mean, Rstd, C, DR, DX, DWp, DBp, M, N, stride_dy, stride_v, stride_dr,
                      tiles_per_prog, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                      MEM_EFF: tl.constexpr, HAS_DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx of column chunk ``program_id(1)`` for the ``tiles_per_prog`` row tiles of group ``program_id(0)``,
    and the group's partial dw/db of the chunk (row ``program_id(0)`` of ``DWp``/``DBp``). (Row groups on the
    grid's first axis, which has no 65,535 limit: their count is the caller's to choose.)"""
    group = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    w, b = _chunk_params(W, B, cols, cmask, HAS_W, HAS_B, MEM_EFF)
    # Per-element sums over the rows walked, reduced across the tile's rows once at the end.
    dw_acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    db_acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for t in range(0, tiles_per_prog):
        rows = (group * tiles_per_prog + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        rows64 = rows.to(tl.int64)
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + rows64[:, None] * stride_v + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=rmask, other=0.0)
        c1 = tl.load(C + rows, mask=rmask, other=0.0)
        mean = rstd
        if not IS_RMS:
            if not MEM_EFF:
                mean = tl.load(Mean + rows, mask=rmask, other=0.0)
        xhat = _xhat(v, w, b, mean, rstd, mask, IS_RMS, HAS_W, HAS_B, MEM_EFF)
        if HAS_W:
            dw_acc += dy * xhat
        if HAS_B:
            db_acc += dy
        if HAS_W:
            wdy = dy * w[None, :]
        else:
            wdy = dy
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.load(C + M + rows, mask=rmask, other=0.0)
            dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DR:
            dr = tl.load(DR + rows64[:, None] * stride_dr + cols[None, :], mask=mask, other=0.0)
            dx += dr.to(tl.float32)
        tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_W:
        tl.store(DWp + group * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
    if HAS_B:
        tl.store(DBp + group * N + cols, tl.sum(db_acc, axis=0), mask=cmask)


def formula(m: int, block_n: int, itemsize: int, is_rms: bool, sms: int) -> dict | None:
    """The launch of this backward where the one-pass kernel's sm_90 code spills, else None (the one-pass
    formula stands). That formula gives a thread 16 elements up to 8,192 columns and 32 at 16,384 (16 warps):
    at 32 the LayerNorm backward spills (89 stores, 110 loads in bf16) and RMSNorm's in fp32; 16-bit RMSNorm
    rows keep the weight out of registers and spill nothing (8 registers with a residual gradient); at 64 and
    more both spill hundreds. (``apex.testing.occupancy``.)

    Here: tiles of one row x 1,024 columns on 4 warps, 8 elements a thread (one 16-byte load of each 16-bit
    input; two rows a tile exchange the weight through shared memory every pass), 40-48 registers, 9-12
    programs resident per SM; 8 programs' worth per SM, each row group's fp32 partial sums (written, then
    read by the reduction) kept under 1/16 of the bytes the rows move.
    """
    if block_n <= 8192 or (is_rms and itemsize <= 2 and block_n <= 16384):
        return None
    split = 1024
    partial_cap = 5 * m * itemsize // 256 * (block_n // split) // sms  # programs per SM within that 1/16
    return {"rows": 1, "warps": 4, "programs_per_sm": max(1, min(8, partial_cap)), "split": split}


def backward(p, dy: torch.Tensor, stride_dy: int, v: torch.Tensor, stride_v: int, m: int, n: int, weight, bias,
             mean, rstd, memory_efficient: bool, is_rms: bool, dresidual, stride_dr: int, dx: torch.Tensor,
             dwp: torch.Tensor, dbp: torch.Tensor) -> None:
    """Both launches of plan ``p`` (``_norm._Plan`` with ``split``): dx, and the partial sums into ``dwp``/``dbp``
    (``p.progs`` rows: one a row group) for ``_norm``'s reduction."""
    has_w, has_b = weight is not None, bias is not None
    w = weight if has_w else v
    b = bias if has_b else v
    c = torch.empty(1 if is_rms else 2, m, dtype=torch.float32, device=v.device)
    # Constexprs positionally, as in _norm: IS_RMS, HAS_W, HAS_B, MEM_EFF, (HAS_DR,) BLOCK_M, BLOCK_N.
    _bwd_stats_kernel[(triton.cdiv(m, p.stats_rows),)](
        dy, v, w, b, mean if mean is not None else rstd, rstd, c, m, n, stride_dy, stride_v,
        is_rms, has_w, has_b, memory_efficient, p.stats_rows, p.split, num_warps=p.warps)
    _bwd_split_kernel[(p.progs, p.chunks)](
        dy, v, w, b, mean if mean is not None else rstd, rstd, c, dresidual if dresidual is not None else dy, dx,
        dwp, dbp, m, n, stride_dy, stride_v, stride_dr, p.per,
        is_rms, has_w, has_b, memory_efficient, dresidual is not None, p.rows, p.split, num_warps=p.warps)
