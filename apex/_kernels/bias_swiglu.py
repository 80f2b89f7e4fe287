"""Bias + SwiGLU, forward and backward in one launch each, on 2-D row views.

``x`` is ``[M, 2N]`` (any strides), ``bias`` ``[2N]`` or absent; ``h = x + bias`` in fp32,
``y = silu(h₁)·h₂`` (``[M, N]``, contiguous). Backward from ``dy``: ``dh₂ = dy·silu(h₁)`` and
``dh₁ = dy·h₂·σ(h₁)·(1 + h₁·(1 − σ(h₁)))``, written into a contiguous ``[M, 2N]``. Each element of ``x``,
``dy``, ``y`` and ``dx`` is read or written once; one rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _norm, _tuning
from apex._kernels._host import cdiv, next_power_of_2


@triton.jit
def _load_h(X, Bias, rows, cols, mask, sxr, sxc, N, HAS_BIAS: tl.constexpr):
    base = X + rows.to(tl.int64)[:, None] * sxr
    h1 = tl.load(base + cols[None, :] * sxc, mask=mask, other=0.0).to(tl.float32)
    h2 = tl.load(base + (cols[None, :] + N) * sxc, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        cm = cols < N
        h1 += tl.load(Bias + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        h2 += tl.load(Bias + cols + N, mask=cm, other=0.0).to(tl.float32)[None, :]
    return h1, h2


@triton.jit
def _fwd_kernel(X, Bias, Y, M, N, sxr, sxc, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    h1, h2 = _load_h(X, Bias, rows, cols, mask, sxr, sxc, N, HAS_BIAS)
    y = h1 * tl.sigmoid(h1) * h2
    tl.store(Y + rows.to(tl.int64)[:, None] * N + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_tile(DY, X, Bias, DX, rows, cols, M, N, sdr, sdc, sxr, sxc, HAS_BIAS: tl.constexpr):
    """Write one ``[rows, cols]`` tile of both halves of ``dx``; return them in fp32 (zero outside the mask)."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    h1, h2 = _load_h(X, Bias, rows, cols, mask, sxr, sxc, N, HAS_BIAS)
    g = tl.load(DY + rows.to(tl.int64)[:, None] * sdr + cols[None, :] * sdc, mask=mask, other=0.0)
    g = g.to(tl.float32)
    sig = tl.sigmoid(h1)
    d1 = g * h2 * sig * (1.0 + h1 * (1.0 - sig))
    d2 = g * h1 * sig
    out = DX + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
    tl.store(out, d1.to(DX.dtype.element_ty), mask=mask)
    tl.store(out + N, d2.to(DX.dtype.element_ty), mask=mask)
    return d1, d2


@triton.jit
def _bwd_kernel(DY, X, Bias, DX, M, N, sdr, sdc, sxr, sxc, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    _bwd_tile(DY, X, Bias, DX, rows, cols, M, N, sdr, sdc, sxr, sxc, HAS_BIAS)


@triton.jit
def _bwd_db_kernel(DY, X, Bias, DX, DB, DBp, M, N, rows_per_prog, sdr, sdc, sxr, sxc, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, STAGES: tl.constexpr, SPLIT: tl.constexpr):
    """Program ``(j, k)``: columns block ``j`` over rows ``[k·rows_per_prog, (k+1)·rows_per_prog)``. One row
    chunk (``SPLIT`` false) writes ``dbias`` itself; several write fp32 partial sums, row ``k`` of ``DBp``."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r0 = tl.program_id(1) * rows_per_prog
    r1 = tl.minimum(r0 + rows_per_prog, M)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    # STAGES > 1: the loads of the next row blocks are issued (cp.async) while this one is computed, so a
    # program that walks many rows keeps more than one block in flight.
    for start in tl.range(r0, r1, BLOCK_M, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        d1, d2 = _bwd_tile(DY, X, Bias, DX, rows, cols, r1, N, sdr, sdc, sxr, sxc, True)
        acc1 += tl.sum(d1, axis=0)
        acc2 += tl.sum(d2, axis=0)
    cm = cols < N
    if SPLIT:
        part = DBp + tl.program_id(1).to(tl.int64) * (2 * N)
        tl.store(part + cols, acc1, mask=cm)
        tl.store(part + cols + N, acc2, mask=cm)
    else:
        tl.store(DB + cols, acc1.to(DB.dtype.element_ty), mask=cm)
        tl.store(DB + cols + N, acc2.to(DB.dtype.element_ty), mask=cm)


def _tiles(M: int, N: int) -> tuple[int, int, tuple[int, int]]:
    bn = min(next_power_of_2(max(N, 1)), 1024)
    bm = max(1, min(next_power_of_2(max(M, 1)), 4096 // bn))
    return bm, bn, (cdiv(M, bm), cdiv(N, bn))


def _config(op: str, x: torch.Tensor, M: int, N: int) -> dict:
    """``{"rows", "cols", "warps"}`` of the one-tile-per-program kernels (``op`` ``bias_swiglu.fwd`` or
    ``.bwd``): the formula's tiles of 4096 elements, 4 warps, unless measured (``_tuning``)."""
    bm, bn, _ = _tiles(M, N)
    return _tuning.pick(op, x.device, x.element_size(), (M, N), {"rows": bm, "cols": bn, "warps": 4})


class Tiles:
    """The forward or backward launch of one ``[M, 2N]`` size (``M·N > 0``): its configuration and kernel bound
    to its grid (``kernel[grid]`` builds that closure at every call otherwise). The argument lists are written
    once, here; this module's launchers and ``apex.ops._bias_act_direct`` both launch through them. ``sx*``,
    ``sd*``: the row and column strides of ``x`` and ``dy``. The constexprs go positionally (a keyword costs a
    launch a dictionary entry to build and bind, ~2,000 instructions)."""

    __slots__ = ("cfg", "M", "N", "bm", "bn", "warps", "_launch")

    def __init__(self, key: tuple, x: torch.Tensor):
        op, M, N = key[0], key[1], key[2]
        cfg = self.cfg = _config(op, x, M, N)
        self.M, self.N, self.bm, self.bn, self.warps = M, N, cfg["rows"], cfg["cols"], cfg["warps"]
        kernel = _fwd_kernel if op == FWD else _bwd_kernel
        self._launch = kernel[(cdiv(M, self.bm), cdiv(N, self.bn))]

    def forward(self, x, sx0: int, sx1: int, bias, y) -> None:
        self._launch(x, bias if bias is not None else x, y, self.M, self.N, sx0, sx1, bias is not None, self.bm,
                     self.bn, num_warps=self.warps)  # HAS_BIAS, BLOCK_M, BLOCK_N

    def backward(self, dy, sd0: int, sd1: int, x, sx0: int, sx1: int, bias, dx) -> None:
        self._launch(dy, x, bias if bias is not None else x, dx, self.M, self.N, sd0, sd1, sx0, sx1,
                     bias is not None, self.bm, self.bn, num_warps=self.warps)  # HAS_BIAS, BLOCK_M, BLOCK_N


FWD, BWD, BWD_DB = "bias_swiglu.fwd", "bias_swiglu.bwd", "bias_swiglu.bwd_db"
# (op, M, N, itemsize, device index) -> Tiles or DbPlan: what a launch derives from its shape.
_PLANS = _tuning.plan_cache()


def planned(key: tuple, x: torch.Tensor):
    """The plan of ``key = (op, M, N, x.element_size(), x.get_device())`` for a launch on ``x``'s device: a
    :class:`Tiles` (``FWD``, ``BWD``) or a :class:`DbPlan` (``BWD_DB``); ``_tuning.last[op]`` its
    configuration, as :func:`_tuning.pick` records it (the configuration this launch takes)."""
    p = _PLANS.get(key)
    if p is None:
        p = _PLANS[key] = DbPlan(key, x) if key[0] == BWD_DB else Tiles(key, x)
    else:
        _tuning.last[key[0]] = p.cfg
    return p


def forward(x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x`` a 2-D ``[M, 2N]`` view; returns ``[M, N]``."""
    M, N = x.shape[0], x.shape[1] // 2
    # Integers (a tuple costs ~1 µs more to parse); new_empty takes x's device (and usually its dtype): no
    # arguments to parse for them.
    y = x.new_empty(M, N) if out_dtype is x.dtype else x.new_empty(M, N, dtype=out_dtype)
    if M * N:
        sx = x.stride()  # one tuple: stride(dim) parses its int-or-name overloads on every call
        planned((FWD, M, N, x.element_size(), x.get_device()), x).forward(x, sx[0], sx[1], bias, y)
    return y


def backward(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``dy`` ``[M, N]`` and ``x`` ``[M, 2N]`` 2-D views; returns ``dx`` ``[M, 2N]``."""
    M, N = x.shape[0], x.shape[1] // 2
    dx = x.new_empty(M, 2 * N) if out_dtype is x.dtype else x.new_empty(M, 2 * N, dtype=out_dtype)
    if M * N:
        sd, sx = dy.stride(), x.stride()
        planned((BWD, M, N, x.element_size(), x.get_device()), x).backward(dy, sd[0], sd[1], x, sx[0], sx[1], bias,
                                                                           dx)
    return dx


def column_tiles(M: int, N: int) -> tuple[int, int, tuple[int]]:
    """Tiles for the column-owning kernels: narrow column blocks so that ~256 programs share the columns
    (one per SM and more on current GPUs), each walking all rows in ``BLOCK_M`` steps."""
    bn = max(16, min(128, next_power_of_2(cdiv(max(N, 1), 256))))
    bm = max(1, min(next_power_of_2(max(M, 1)), 4096 // bn))
    return bm, bn, (cdiv(N, bn),)


def _db_formula(M: int, N: int, dev: torch.device) -> dict:
    """Column blocks of 128 (a 256-byte contiguous run of each row of bf16 x, dy and dx: the narrow blocks of
    ``column_tiles``, 32 columns at N = 8192, read 64-byte runs, each warp's 16-byte load spanning 8 rows),
    32 rows a pass, and the rows cut into chunks ("splits") until there are 2 programs per SM, each chunk at
    least 8 passes (fewer rows stay one launch); the chunks' fp32 partial sums (splits x 2N x 4 bytes, 0.6 MB
    at 16384 x 2·8192 against 1.3 GB of rows) are summed in a fixed order by a second launch.
    """
    cols = max(16, min(128, next_power_of_2(max(N, 1))))
    rows = max(1, min(next_power_of_2(max(M, 1)), 4096 // cols))
    sms = _tuning.device(dev)[1] or 132
    splits = max(1, min(cdiv(2 * sms, cdiv(N, cols)), cdiv(M, 8 * rows)))
    return {"rows": rows, "cols": cols, "warps": 4, "stages": 1, "splits": splits}


class DbPlan:
    """The backward with the bias gradient of one ``[M, 2N]`` size (``N > 0``): :func:`_db_formula`'s
    configuration (or ``_tuning``'s), the rows per chunk, the kernel bound to its grid and, where the rows are
    split, the fixed-order sum of the chunks' fp32 partials bound to its own."""

    __slots__ = ("cfg", "M", "N", "per", "splits", "bm", "bn", "stages", "warps", "_launch", "_reduce")

    def __init__(self, key: tuple, x: torch.Tensor):
        op, M, N = key[0], key[1], key[2]
        dev = x.device
        cfg = self.cfg = _tuning.pick(op, dev, key[3], (M, N), _db_formula(M, N, dev))
        per = cdiv(cdiv(max(M, 1), cfg["splits"]), cfg["rows"]) * cfg["rows"]
        self.M, self.N, self.per, self.splits = M, N, per, cdiv(max(M, 1), per)
        self.bm, self.bn, self.stages, self.warps = cfg["rows"], cfg["cols"], cfg["stages"], cfg["warps"]
        self._launch = _bwd_db_kernel[(cdiv(N, self.bn), self.splits)]
        self._reduce = _norm._reduce_kernel[(cdiv(2 * N, 128),)]

    def backward_db(self, dy, sd0: int, sd1: int, x, sx0: int, sx1: int, bias, dx, db) -> None:
        """``dx`` and ``db = Σ_rows dx`` (``bias`` contiguous): one launch, two where the rows are split."""
        splits, N = self.splits, self.N
        part = x.new_empty(splits, 2 * N, dtype=torch.float32) if splits > 1 else db
        self._launch(dy, x, bias, dx, db, part, self.M, N, self.per, sd0, sd1, sx0, sx1, self.bm, self.bn,
                     self.stages, splits > 1, num_warps=self.warps)  # BLOCK_M, BLOCK_N, STAGES, SPLIT
        if splits > 1:
            # The norms' fixed-order column sum of fp32 partial rows, one rounding to the bias dtype.
            self._reduce(part, part, db, db, splits, 2 * N, False, 32, 128)


def backward_with_bias_grad(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor,
                            out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`backward`, also returning ``dbias = Σ_rows dx`` (fp32 sums, one rounding to the bias dtype),
    in one launch (two where the rows are split: a fixed-order sum of the chunks' fp32 partials)."""
    M, N = x.shape[0], x.shape[1] // 2
    dx = x.new_empty(M, 2 * N) if out_dtype is x.dtype else x.new_empty(M, 2 * N, dtype=out_dtype)
    db = bias.new_empty(2 * N)
    if N:
        sd, sx = dy.stride(), x.stride()
        planned((BWD_DB, M, N, x.element_size(), x.get_device()), x).backward_db(dy, sd[0], sd[1], x, sx[0], sx[1],
                                                                                 bias, dx, db)
    return dx, db
