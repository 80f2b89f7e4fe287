"""One-pass LayerNorm / RMSNorm: the configurations, plans and launches of ``_norm_jit``'s kernels, shared by
``_kernels/layer_norm.py`` and ``_kernels/rms_norm.py``.

Rows are processed in tiles of ``BLOCK_M`` rows by ``BLOCK_N >= N`` columns, so a row is read once and
written once. Each program walks ``tiles_per_prog`` consecutive tiles.

* forward: ``y = (x - mean) * rstd * w + b`` (LayerNorm) or ``y = x * rstd * w`` (RMSNorm), statistics in
  fp32, one rounding to the output dtype; per-row ``mean`` (LayerNorm only) and ``rstd`` in fp32. With a
  residual, ``h = x + r`` is stored (rounded to its dtype) and normalised.
* backward: ``x̂`` from the saved input (or from the saved output when memory-efficient),
  ``dx = rstd * (w·dy − mean(w·dy) − x̂ · mean(w·dy·x̂))`` (RMSNorm drops the middle term); each program
  writes its partial ``Σ dy·x̂`` and ``Σ dy`` over its rows, and a second launch sums those partials in a
  fixed order (deterministic, no atomics). Rows too wide for that in registers take ``_norm_wide``'s
  backward instead (a plan's ``split``: the statistics of each row first, then column chunks).
"""

from __future__ import annotations

import torch

from apex._kernels import _norm_wide, _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2

# (the kernels' names are this module's too: launchers and tests reach them here)
from apex._kernels._norm_jit import _bwd_kernel, _fwd_kernel, _reduce_kernel, _row_tile, _rstd  # noqa: F401

# The interpreter pays per operation, not per element: big tiles, few programs (read once: see _host).
_INTERP = interpreted(_fwd_kernel)
# (rows, columns, itemsize, device index, is_rms, backward) -> _Plan: what a launch derives from its shape.
_PLANS = _tuning.plan_cache()


def _config(m: int, n: int, dev: torch.device, itemsize: int, is_rms: bool, backward: bool) -> dict:
    """``{"rows", "warps", "programs_per_sm"}`` for rows of length ``n``: ``rows`` rows per tile,
    ``programs_per_sm`` caps the grid at that many programs per SM (each then walks several tiles; 0: one
    program per tile); backward, ``split``: 0 (the one-pass kernel) or ``_norm_wide``'s column chunk. The
    measured table or an override (``_tuning``) may replace the formula's values (an entry without ``split``
    was measured for the one-pass kernel).
    No ``num_stages``: Triton pipelines only ``tl.range(num_stages=...)`` loops and loads that feed a dot,
    so the launch option leaves these loops' code unchanged (the compiled code is the same for 1 and 3)."""
    block_n = next_power_of_2(max(n, 1))
    op = _op_name(is_rms, backward)
    if _INTERP:
        default = {"rows": max(1, min(next_power_of_2(max(m, 1)), 65536 // block_n)), "warps": 1,
                   "programs_per_sm": 1}
    else:
        sms = _tuning.device(dev)[1] or 132
        default = _formula(m, block_n, itemsize, backward, sms)
        wide = _norm_wide.formula(m, block_n, itemsize, is_rms, sms) if backward else None
        if wide is not None:
            return _tuning.pick(op, dev, itemsize, (m, n), wide, measured_base=default)
    if not backward:
        # Entries measured before "wtile" existed ran with the parameters held (0); a configuration that does
        # not name it (the formula's, an override's) takes the rule below for its own tile.
        cfg = _tuning.pick(op, dev, itemsize, (m, n), default, measured_base={**default, "wtile": 0})
        if "wtile" not in cfg:
            cfg["wtile"] = int(cfg["rows"] * block_n >= _WTILE_ELEMENTS * 32 * cfg["warps"])
        return cfg
    return _tuning.pick(op, dev, itemsize, (m, n), default)


# The forward reads weight and bias per tile ("wtile": 1), after the row's sums, from this many elements a
# thread up; below, it holds them in fp32 registers across its passes. Held, each parameter row costs a
# register per element a thread for the whole pass: at 64 elements a thread (8192 columns on 4 warps, 16384
# on 8) a LayerNorm's weight and bias take 128 of its 232 registers on sm_90, two programs per SM where
# RMSNorm's 153 fit three; read per tile, 135 (three). Measured on the H200, the LayerNorm forward at 8192
# and 16384 columns reached 66% of the copy rate against RMSNorm's 83-90%.
_WTILE_ELEMENTS = 32


def _op_name(is_rms: bool, backward: bool) -> str:
    return ("rms_norm" if is_rms else "layer_norm") + (".bwd" if backward else ".fwd")


def _formula(m: int, block_n: int, itemsize: int, backward: bool, sms: int) -> dict:
    """The launch the occupancy model picks on Hopper-class GPUs (``apex.testing.occupancy``; the figures
    are in docs/benchmarks.md, "Kernel configurations").

    Forward: one row per program (rows under 1024 columns share one), one warp per 1024 columns: 32
    elements a thread, four 16-byte loads of bf16. A row's mean and variance are block-wide sums whose
    shuffles, barriers and setup every warp pays, so warps beyond that add issue time, not bandwidth: 16
    warps on 4096 columns (the former launch) issue ~390 SASS instructions a warp for 8 elements a thread,
    ~98 us for a 16384 x 4096 bf16 LayerNorm against 63 us of memory at the copy rate; 4 warps, ~44 us.

    Backward: one row a pass from 1024 columns up (a tile of several rows also sums dw/db across warps
    every pass: 20 barriers a pass instead of 4), one warp per 512 columns (16 elements a thread: each
    thread also keeps its columns' dw/db accumulators in registers), and 16 warps' worth of programs per
    SM, each walking its share of the rows, so that one program's loads are in flight while another
    reduces: a single 16-warp program per SM (the former launch) waits out every pass's DRAM latency alone.
    The programs' fp32 partial rows (written, then read by the reduction) stay under 1/16 of the bytes the
    rows move.
    """
    rows = max(1, min(16, 1024 // block_n))  # rows under 1024 columns share a program (a pass)
    if backward:
        warps = max(1, min(16, rows * block_n // 512))
        partial_cap = 3 * m * itemsize // 256 // sms  # programs per SM whose partials stay under 1/16
        return {"rows": rows, "warps": warps, "programs_per_sm": max(1, min(16 // warps, partial_cap)), "split": 0}
    return {"rows": rows, "warps": max(1, min(16, rows * block_n // 1024)), "programs_per_sm": 0}


def _grid(m: int, dev: torch.device, cfg: dict, chunks: int = 1) -> tuple[int, int]:
    """(programs, tiles per program) covering the ``m`` rows in tiles of ``cfg["rows"]``; with ``chunks``
    column chunks, programs of one chunk (``programs_per_sm`` caps all chunks' programs together)."""
    n_tiles = cdiv(m, cfg["rows"])
    # Without a GPU (the interpreter) a program per SM stands for a program per hundredth of the rows.
    sms = _tuning.device(dev)[1] or 100
    progs = n_tiles if cfg["programs_per_sm"] <= 0 else max(1, min(n_tiles, cfg["programs_per_sm"] * sms // chunks))
    per = cdiv(n_tiles, progs)
    return cdiv(n_tiles, per), per


class _Plan:
    """One shape's launch: configuration, grid, block sizes and, for the backward, its reduction's."""

    __slots__ = ("op", "cfg", "progs", "per", "block_n", "rows", "warps", "red_grid", "red_p", "red_n",
                 "w_per_tile", "split", "chunks", "stats_rows", "m", "n", "is_rms", "_launch", "_reduce")

    def __init__(self, m: int, n: int, dev: torch.device, itemsize: int, is_rms: bool, backward: bool):
        self.m, self.n, self.is_rms = m, n, is_rms
        self.op = _op_name(is_rms, backward)
        self.cfg = cfg = _config(m, n, dev, itemsize, is_rms, backward)
        # The column-chunked backward (_norm_wide) where the configuration asks for it; never for rows of
        # one or two elements, whose dx has its own exact form (ONE_DIRECTION).
        self.split = split = cfg.get("split", 0) if backward and n > 2 else 0
        self.chunks = cdiv(n, split) if split else 1
        self.progs, self.per = _grid(m, dev, cfg, self.chunks)
        self.block_n = next_power_of_2(n)
        self.rows, self.warps = cfg["rows"], cfg["warps"]
        if _INTERP:  # (_norm_wide's row statistics too: few programs, tiles of up to 65536 elements)
            self.red_n = min(self.block_n, 4096)
            self.red_p = max(1, min(next_power_of_2(self.progs), 65536 // self.red_n))
            self.stats_rows = max(self.rows, min(next_power_of_2(m), 65536 // max(split, 1)))
        else:
            self.red_n, self.red_p, self.stats_rows = 128, 32, self.rows
        self.red_grid = cdiv(n, self.red_n)
        # Each kernel bound to its grid once (``kernel[grid]`` builds that closure at every launch otherwise).
        if not backward:
            self.w_per_tile = bool(cfg.get("wtile", 0))
            self._launch, self._reduce = _fwd_kernel[(self.progs,)], None
            return
        self._launch, self._reduce = _bwd_kernel[(self.progs,)], _reduce_kernel[(self.red_grid,)]
        # RMSNorm's backward at 32 elements a thread and more (16384 columns on 16 warps) keeps the weight out
        # of registers between passes: held, it spills 50 registers a pass on sm_90; reloaded, none. (The
        # LayerNorm backward's dw and db sums alone fill half the registers there: it spills either way. The
        # formula leaves the rows where either spills to _norm_wide: see _norm_wide.formula.)
        self.w_per_tile = is_rms and backward and self.rows * self.block_n >= 32 * 32 * self.warps

    # The launches of a plan, written once: this module's launchers and apex.ops._norm_direct (which keeps the
    # plans of an argument layout) both launch through these (the same arguments: the same bits). The outputs are
    # the caller's; the constexprs go positionally (a keyword costs a launch ~2,000 instructions to bind).
    def forward(self, x: torch.Tensor, stride_x: int, weight, bias, eps: float, residual, stride_r: int, h, y,
                mean, rstd) -> None:
        """The forward launch on ``x``'s ``m`` rows (``mean``: ``rstd`` for RMSNorm; ``h``: None without a
        residual). Constexprs: IS_RMS, HAS_W, HAS_B, HAS_RES, BLOCK_M, BLOCK_N, W_PER_TILE."""
        self._launch(x, residual if residual is not None else x, h if h is not None else y, y,
                     weight if weight is not None else x, bias if bias is not None else x, mean, rstd,
                     self.m, self.n, stride_x, stride_r, eps, self.per,
                     self.is_rms, weight is not None, bias is not None, residual is not None, self.rows,
                     self.block_n, self.w_per_tile, num_warps=self.warps)

    def backward(self, dy: torch.Tensor, stride_dy: int, v: torch.Tensor, stride_v: int, weight, bias, mean, rstd,
                 memory_efficient: bool, dresidual, stride_dr: int, eps: float | None, dx: torch.Tensor) -> tuple:
        """The backward launches (the rows', then the partial sums' reduction) writing ``dx``: ``(dw, db)``, None
        for an absent parameter."""
        m, n, progs = self.m, self.n, self.progs
        has_w, has_b = weight is not None, bias is not None
        dw = torch.empty_like(weight) if has_w else None
        db = torch.empty_like(bias) if has_b else None
        if rstd.dtype is _F32:  # (the forward's statistics are): new_empty of an fp32 tensor, no keywords to parse
            dwp = rstd.new_empty(progs, n) if has_w else dx
            dbp = rstd.new_empty(progs, n) if has_b else dx
        else:
            dwp = torch.empty(progs, n, dtype=_F32, device=v.device) if has_w else dx
            dbp = torch.empty(progs, n, dtype=_F32, device=v.device) if has_b else dx
        if self.split:
            _norm_wide.backward(self, dy, stride_dy, v, stride_v, m, n, weight, bias, mean, rstd, memory_efficient,
                                self.is_rms, dresidual, stride_dr, dx, dwp, dbp)
        else:
            # IS_RMS, HAS_W, HAS_B, MEM_EFF, HAS_DR, ONE_DIRECTION, BLOCK_M, BLOCK_N, W_PER_TILE
            self._launch(
                dy, v, weight if has_w else v, bias if has_b else v, mean if mean is not None else rstd, rstd,
                dresidual if dresidual is not None else dy, dx, dwp, dbp,
                m, n, stride_dy, stride_v, stride_dr, self.per, float(eps) if eps is not None else 0.0,
                self.is_rms, has_w, has_b, memory_efficient, dresidual is not None,
                eps is not None and n <= (1 if self.is_rms else 2), self.rows, self.block_n, self.w_per_tile,
                num_warps=self.warps)
        if has_w:  # the reduction's HAS_B, BLOCK_P, BLOCK_N
            self._reduce(dwp, dbp, dw, db if has_b else dw, progs, n, has_b, self.red_p, self.red_n)
        elif has_b:  # bias without weight: reduce the bias partials alone
            _reduce_kernel[(cdiv(n, 128),)](dbp, dbp, db, db, progs, n, False, 32, 128)
        return dw, db


def _plan(x: torch.Tensor, m: int, n: int, is_rms: bool, backward: bool) -> _Plan:
    key = (m, n, x.element_size(), x.get_device(), is_rms, backward)
    p = _PLANS.get(key)
    if p is None:
        return _new_plan(key, x.device)
    _tuning.last[p.op] = p.cfg  # as pick records it: the configuration this launch takes
    return p


def _new_plan(key: tuple, dev: torch.device) -> _Plan:
    """The plan of ``key`` (see ``_PLANS``), made and kept. The launchers look ``_PLANS`` up themselves (as
    :func:`_plan` does, a frame fewer a call) and come here on a miss."""
    m, n, itemsize, _, is_rms, backward = key
    p = _PLANS[key] = _Plan(m, n, dev, itemsize, is_rms, backward)
    return p


def plan(x: torch.Tensor, is_rms: bool, backward: bool) -> tuple[dict, int, int]:
    """(configuration, programs, tiles per program) of the launch on the 2-D ``x`` (the benchmarks' notes)."""
    m, n = x.shape
    p = _plan(x, m, n, is_rms, backward)
    return p.cfg, p.progs, p.per


_F32 = torch.float32


def _alloc(like: torch.Tensor | None, m: int, n: int, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A row-major ``(m, n)`` buffer, shaped as ``like`` when given (its caller's shape: no view to take
    afterwards). Integers as separate arguments: ``torch.empty((m, n))`` parses its tuple for ~1 µs more."""
    if like is not None:
        return torch.empty_like(like, dtype=dtype, memory_format=torch.contiguous_format)
    return torch.empty(m, n, dtype=dtype, device=dev)


def forward(x: torch.Tensor, weight, bias, eps: float, out_dtype: torch.dtype, is_rms: bool,
            residual: torch.Tensor | None = None, residual_dtype: torch.dtype | None = None,
            out_like: torch.Tensor | None = None):
    """``x``, ``residual``: 2-D ``(M, N)`` with unit column stride. Returns ``(y, mean, rstd, h)``; ``y`` and
    ``h`` have the shape of ``out_like`` when it is given (a tensor of which ``x`` is the ``(M, N)`` view),
    else ``(M, N)``."""
    m, n = x.shape
    return forward_rows(x, x.stride(0), m, n, weight, bias, eps, out_dtype, is_rms, residual,
                        residual.stride(0) if residual is not None else 0, residual_dtype, out_like)


def forward_rows(x: torch.Tensor, stride_x: int, m: int, n: int, weight, bias, eps: float, out_dtype: torch.dtype,
                 is_rms: bool, residual: torch.Tensor | None, stride_r: int, residual_dtype: torch.dtype | None,
                 out_like: torch.Tensor | None):
    """:func:`forward` on tensors of ``m`` rows of ``n`` elements at the given row strides (unit column stride),
    whatever their shapes, as :func:`backward_rows`: a contiguous input is its own rows (no 2-D view, no shape
    or stride query)."""
    # A dtype, device or memory_format keyword costs an allocation ~2,000 instructions to parse (~0.5 µs, as
    # much as the rest of it): the usual output (the dtype of a contiguous out_like) is empty_like's alone, the
    # fp32 statistics new_empty's of an fp32 tensor (x, or rstd for mean).
    if out_like is not None and out_like.dtype is out_dtype and out_like.is_contiguous():
        y = torch.empty_like(out_like)
    else:
        y = _alloc(out_like, m, n, out_dtype, x.device)
    rstd = x.new_empty(m) if x.dtype is _F32 else torch.empty(m, dtype=_F32, device=x.device)
    mean = rstd if is_rms else rstd.new_empty(m)
    h = None
    if residual is not None:
        h = _alloc(out_like, m, n, residual_dtype or x.dtype, x.device)
    if m == 0 or n == 0:
        if n == 0:
            rstd.fill_(float("nan"))
        return y, (None if is_rms else mean), rstd, h
    # _plan inlined (a frame fewer a call).
    key = (m, n, x.element_size(), x.get_device(), is_rms, False)
    p = _PLANS.get(key)
    if p is None:
        p = _new_plan(key, x.device)
    else:
        _tuning.last[p.op] = p.cfg
    p.forward(x, stride_x, weight, bias, float(eps), residual, stride_r, h, y, mean, rstd)
    return y, (None if is_rms else mean), rstd, h


def backward(dy: torch.Tensor, v: torch.Tensor, weight, bias, mean, rstd, memory_efficient: bool,
             is_rms: bool, dx_dtype: torch.dtype, dresidual: torch.Tensor | None = None,
             eps: float | None = None, out_like: torch.Tensor | None = None):
    """``dy``, ``v`` (input, or output when memory-efficient), ``dresidual``: 2-D ``(M, N)``. ``eps``: the
    forward's epsilon; with it, rows of one element (RMSNorm) or two (LayerNorm) keep fp32 accuracy.
    ``out_like``: as :func:`forward`'s, for ``dx``.

    Returns ``(dx, dweight, dbias)``; ``dweight``/``dbias`` are None without weight/bias.
    """
    m, n = v.shape
    return backward_rows(dy, dy.stride(0), v, v.stride(0), m, n, weight, bias, mean, rstd, memory_efficient, is_rms,
                         dx_dtype, dresidual, dresidual.stride(0) if dresidual is not None else 0, eps, out_like)


def backward_rows(dy: torch.Tensor, stride_dy: int, v: torch.Tensor, stride_v: int, m: int, n: int, weight, bias,
                  mean, rstd, memory_efficient: bool, is_rms: bool, dx_dtype: torch.dtype,
                  dresidual: torch.Tensor | None, stride_dr: int, eps: float | None, out_like: torch.Tensor | None):
    """:func:`backward` on tensors of ``m`` rows of ``n`` elements at the given row strides (unit column stride),
    whatever their shapes: a contiguous tensor is its own rows, so a caller that knows the layout (the forward
    made it, or ``is_contiguous`` says so) passes it without a 2-D view or a stride query (~1 µs each)."""
    # Allocations without keywords where they can, as in forward (the partial sums: new_empty of the fp32 rstd).
    if out_like is not None and out_like.dtype is dx_dtype and out_like.is_contiguous():
        dx = torch.empty_like(out_like)
    else:
        dx = _alloc(out_like, m, n, dx_dtype, v.device)
    if m == 0 or n == 0:
        dw = torch.zeros_like(weight) if weight is not None else None
        db = torch.zeros_like(bias) if bias is not None else None
        if dresidual is not None:
            dx.view(m, n).copy_(dresidual.reshape(m, n))  # the caller's shape, maybe not 2-D
        return dx, dw, db
    key = (m, n, v.element_size(), v.get_device(), is_rms, True)  # _plan inlined, as in forward
    p = _PLANS.get(key)
    if p is None:
        p = _new_plan(key, v.device)
    else:
        _tuning.last[p.op] = p.cfg
    dw, db = p.backward(dy, stride_dy, v, stride_v, weight, bias, mean, rstd, memory_efficient, dresidual, stride_dr,
                        eps, dx)
    return dx, dw, db
