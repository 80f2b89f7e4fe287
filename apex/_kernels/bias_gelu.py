"""Bias + GELU (tanh approximation), forward and backward in one launch each, on 2-D row views.

``h = x + bias`` in fp32, ``y = h/2 · (1 + tanh(√(2/π)·(h + 0.044715 h³)))``; backward
``dx = dy · (½(1 + t) + ½h(1 − t²)·√(2/π)(1 + 3·0.044715 h²))`` with ``t`` the tanh above. Both are
written with ``σ(2z) = (1 + tanh z)/2`` (libdevice's tanh is unavailable under the interpreter, and
``1 − t² = 4σ(2z)σ(−2z)`` avoids a cancellation). One rounding to the output dtype.

With the bias gradient (``backward_with_bias_grad``) the backward stays one launch: each program owns a
block of columns and walks every row, summing ``dbias`` in fp32 registers in a fixed order (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels._host import cdiv, next_power_of_2
from apex._kernels.bias_swiglu import column_tiles


@triton.jit
def _arg(h):
    """``2z`` for ``z = √(2/π)(h + 0.044715 h³)``: ``σ(2z) = (1 + tanh z) / 2``."""
    return 2.0 * 0.7978845608028654 * (h + 0.044715 * h * h * h)


@triton.jit
def _fwd_kernel(X, Bias, Y, M, N, sxr, sxc, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    h = tl.load(X + rows.to(tl.int64)[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0)
    h = h.to(tl.float32)
    if HAS_BIAS:
        h += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    y = h * tl.sigmoid(_arg(h))
    tl.store(Y + rows.to(tl.int64)[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile(DY, X, Bias, DX, rows, cols, M, N, sdr, sdc, sxr, sxc, HAS_BIAS: tl.constexpr):
    """Write one ``[rows, cols]`` tile of ``dx``; return it in fp32 (zero outside the mask)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    h = tl.load(X + rows.to(tl.int64)[:, None] * sxr + cols[None, :] * sxc, mask=mask, other=0.0)
    h = h.to(tl.float32)
    if HAS_BIAS:
        h += tl.load(Bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    g = tl.load(DY + rows.to(tl.int64)[:, None] * sdr + cols[None, :] * sdc, mask=mask, other=0.0)
    a = _arg(h)
    sg = tl.sigmoid(a)
    # d/dh [h·σ(2z)] = σ + 2h·σ(2z)σ(−2z)·dz/dh; σ(2z)σ(−2z) avoids the cancellations of 1 − tanh² and 1 − σ
    dgelu = sg + 2.0 * h * sg * tl.sigmoid(-a) * (0.7978845608028654 * (1.0 + 3.0 * 0.044715 * h * h))
    dx = g.to(tl.float32) * dgelu
    tl.store(DX + rows.to(tl.int64)[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    return dx


@triton.jit
def _bwd_kernel(DY, X, Bias, DX, M, N, sdr, sdc, sxr, sxc, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _bwd_tile(DY, X, Bias, DX, rows, cols, M, N, sdr, sdc, sxr, sxc, HAS_BIAS)


@triton.jit
def _bwd_db_kernel(DY, X, Bias, DX, DB, M, N, sdr, sdc, sxr, sxc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        acc += tl.sum(_bwd_tile(DY, X, Bias, DX, rows, cols, M, N, sdr, sdc, sxr, sxc, True), axis=0)
    tl.store(DB + cols, acc.to(DB.dtype.element_ty), mask=cols < N)


def _tiles(M: int, N: int) -> tuple[int, int, tuple[int, int]]:
    bn = min(next_power_of_2(max(N, 1)), 1024)
    bm = max(1, min(next_power_of_2(max(M, 1)), 4096 // bn))
    return bm, bn, (cdiv(M, bm), cdiv(N, bn))


def forward(x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x`` a 2-D ``[M, N]`` view; returns contiguous ``[M, N]``."""
    M, N = x.shape
    # new_empty takes x's device (and usually its dtype): no arguments to parse for them.
    y = x.new_empty(M, N) if out_dtype is x.dtype else x.new_empty(M, N, dtype=out_dtype)
    if M * N:
        bm, bn, grid = _tiles(M, N)
        sx = x.stride()  # one tuple: stride(dim) parses its int-or-name overloads on every call
        # The constexprs positionally (HAS_BIAS, BLOCK_M, BLOCK_N): each keyword costs a launch ~2,000
        # instructions of dictionary building and binding.
        _fwd_kernel[grid](x, bias if bias is not None else x, y, M, N, sx[0], sx[1], bias is not None, bm, bn)
    return y


def backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    M, N = x.shape
    dx = x.new_empty(M, N) if out_dtype is x.dtype else x.new_empty(M, N, dtype=out_dtype)
    if M * N:
        bm, bn, grid = _tiles(M, N)
        sd, sx = dy.stride(), x.stride()
        _bwd_kernel[grid](dy, x, bias if bias is not None else x, dx, M, N, sd[0], sd[1], sx[0], sx[1],
                          bias is not None, bm, bn)  # HAS_BIAS, BLOCK_M, BLOCK_N
    return dx


def backward_with_bias_grad(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`backward`, also returning ``dbias = Σ_rows dx`` (fp32 sum, bias dtype), in one launch."""
    M, N = x.shape
    dx = x.new_empty(M, N) if out_dtype is x.dtype else x.new_empty(M, N, dtype=out_dtype)
    db = bias.new_empty(N)
    if N:
        bm, bn, grid = column_tiles(M, N)
        sd, sx = dy.stride(), x.stride()
        _bwd_db_kernel[grid](dy, x, bias, dx, db, M, N, sd[0], sd[1], sx[0], sx[1], bm, bn)  # BLOCK_M, BLOCK_N
    return dx, db
