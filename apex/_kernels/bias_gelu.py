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


class Plan:
    """The launches of one ``[M, N]`` size (``M·N > 0``): tiles, and each kernel bound to its grid
    (``kernel[grid]`` builds that closure at every call otherwise). Each kernel's argument list is written once,
    in a method below; this module's launchers and ``apex.ops._bias_act_direct`` (which keeps the plan of an
    input layout) both launch through them. ``sx*``, ``sd*``: the row and column strides of ``x`` and ``dy``;
    the outputs are contiguous ``[M, N]`` (and ``[N]``). The constexprs go positionally: a keyword costs a
    launch a dictionary entry to build and bind (~2,000 instructions)."""

    __slots__ = ("M", "N", "bm", "bn", "cbm", "cbn", "_fwd", "_bwd", "_bwd_db")

    def __init__(self, M: int, N: int):
        self.M, self.N = M, N
        self.bm, self.bn, grid = _tiles(M, N)
        self.cbm, self.cbn, cgrid = column_tiles(M, N)
        self._fwd, self._bwd, self._bwd_db = _fwd_kernel[grid], _bwd_kernel[grid], _bwd_db_kernel[cgrid]

    def forward(self, x, sx0: int, sx1: int, bias, y) -> None:
        self._fwd(x, bias if bias is not None else x, y, self.M, self.N, sx0, sx1, bias is not None, self.bm,
                  self.bn)  # HAS_BIAS, BLOCK_M, BLOCK_N

    def backward(self, dy, sd0: int, sd1: int, x, sx0: int, sx1: int, bias, dx) -> None:
        self._bwd(dy, x, bias if bias is not None else x, dx, self.M, self.N, sd0, sd1, sx0, sx1, bias is not None,
                  self.bm, self.bn)  # HAS_BIAS, BLOCK_M, BLOCK_N

    def backward_db(self, dy, sd0: int, sd1: int, x, sx0: int, sx1: int, bias, dx, db) -> None:
        """``dx`` and ``db = Σ_rows dx`` (``bias`` contiguous) in one launch."""
        self._bwd_db(dy, x, bias, dx, db, self.M, self.N, sd0, sd1, sx0, sx1, self.cbm, self.cbn)  # BLOCK_M/N


_PLANS: dict = {}  # (M, N) -> Plan: pure functions of the size, never stale


def plan(M: int, N: int) -> Plan:
    p = _PLANS.get((M, N))
    if p is None:
        if len(_PLANS) >= 256:  # sizes that keep changing (variable batch): stay bounded
            _PLANS.clear()
        p = _PLANS[(M, N)] = Plan(M, N)
    return p


def forward(x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x`` a 2-D ``[M, N]`` view; returns contiguous ``[M, N]``."""
    M, N = x.shape
    # new_empty takes x's device (and usually its dtype): no arguments to parse for them.
    y = x.new_empty(M, N) if out_dtype is x.dtype else x.new_empty(M, N, dtype=out_dtype)
    if M * N:
        sx = x.stride()  # one tuple: stride(dim) parses its int-or-name overloads on every call
        plan(M, N).forward(x, sx[0], sx[1], bias, y)
    return y


def backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    M, N = x.shape
    dx = x.new_empty(M, N) if out_dtype is x.dtype else x.new_empty(M, N, dtype=out_dtype)
    if M * N:
        sd, sx = dy.stride(), x.stride()
        plan(M, N).backward(dy, sd[0], sd[1], x, sx[0], sx[1], bias, dx)
    return dx


def backward_with_bias_grad(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`backward`, also returning ``dbias = Σ_rows dx`` (fp32 sum, bias dtype), in one launch."""
    M, N = x.shape
    dx = x.new_empty(M, N) if out_dtype is x.dtype else x.new_empty(M, N, dtype=out_dtype)
    db = bias.new_empty(N)
    if N:
        sd, sx = dy.stride(), x.stride()
        if M:
            plan(M, N).backward_db(dy, sd[0], sd[1], x, sx[0], sx[1], bias, dx, db)
        else:  # no rows: the kernel writes dbias = 0 (a plan is of a non-empty size)
            bm, bn, grid = column_tiles(M, N)
            _bwd_db_kernel[grid](dy, x, bias, dx, db, M, N, sd[0], sd[1], sx[0], sx[1], bm, bn)  # BLOCK_M, BLOCK_N
    return dx, db
