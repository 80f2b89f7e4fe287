"""Triton kernels of SyncBatchNorm on a contiguous ``[N, C, L]`` input (channel-last is ``L = 1``).

Element ``(n, c, l)`` lives at ``n*C*L + c*L + l``; ``r = n*L + l`` runs over the ``R = N*L`` values of a
channel. A program owns ``BLOCK_C`` channels and ``ITERS`` tiles of ``BLOCK_R`` values of ``r``, so both
layouts read memory in contiguous runs (along ``l`` channel-first, along ``c`` channel-last). Reductions
write one fp32 partial per (program row, channel); a second, per-channel kernel sums the partial rows in a
fixed order, so results are deterministic (no atomics). Each kernel reads its inputs once and writes its
outputs once.

The training step's host work is a handful of launches: forward = statistics partials, ``_finish_kernel``
(partial rows -> mean, invstd, scale, shift, running statistics; with ranks, once to the fp64 row that is
all-gathered and once to merge the gathered rows), normalise; backward = reduction partials,
``_backward_finish_kernel`` (-> the two sums, grad_weight, grad_bias), elementwise. Each per-channel PyTorch
operator these replace costs a few microseconds of dispatch on the host and a launch on the GPU.

Buffers, fp32 ``[rows, C]``: ``st`` = mean, invstd, scale, shift (what the elementwise kernels read and the
backward keeps); the forward's workspace = the shift ``x0``, then the ``P`` rows of Σ(x - x0), then the ``P`` rows
of Σ(x - x0)²; the backward's = Σ dy', Σ dy' (x - mean) (all-reduced with ranks), then the two sets of ``P``
partial rows. Kernels take the ``(N, C, L)`` sizes, not views, so launchers reshape nothing; every launch
goes through the :class:`Plan` of its size, whose methods write each kernel's argument list once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _tile(pc, pr, it, C, L, R, ITERS, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    r = ((pr * ITERS + it) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    n = r // L
    l_ = r - n * L
    off = (n * C * L + l_)[:, None] + (c.to(tl.int64) * L)[None, :]
    mask = (r < R)[:, None] & (c < C)[None, :]
    return off, mask


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_tile)


@triton.jit
def _channel_block(C, BLOCK_C: tl.constexpr):
    """This program's column ``pc`` and row ``pr`` in the grid, its channels and their mask."""
    pc = tl.program_id(0)
    pr = tl.program_id(1)
    c = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    return pc, pr, c, c < C


@triton.jit
def _stats_kernel(x_ptr, ws_ptr, C, L, R, ITERS, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
    rows = tl.num_programs(1)
    # Shifted sums: Σ(x - x0) and Σ(x - x0)² with x0 the channel's first element keep fp32 accurate.
    shift = tl.load(x_ptr + c.to(tl.int64) * L, mask=cmask, other=0.0).to(tl.float32)
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for it in range(ITERS):
        off, mask = _tile(pc, pr, it, C, L, R, ITERS, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(mask, x - shift[None, :], 0.0)
        acc1 += d
        acc2 += d * d
    tl.store(ws_ptr + (1 + pr) * C + c, tl.sum(acc1, axis=0), mask=cmask)
    tl.store(ws_ptr + (1 + rows + pr) * C + c, tl.sum(acc2, axis=0), mask=cmask)
    tl.store(ws_ptr + c, shift, mask=cmask & ((c * 0 + pr) == 0))


@triton.jit
def _forward_kernel(x_ptr, z_ptr, y_ptr, st_ptr, C, L, R, ITERS, HAS_Z: tl.constexpr, RELU: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
    scale = tl.load(st_ptr + 2 * C + c, mask=cmask, other=0.0)
    shift = tl.load(st_ptr + 3 * C + c, mask=cmask, other=0.0)
    for it in range(ITERS):
        off, mask = _tile(pc, pr, it, C, L, R, ITERS, BLOCK_R, BLOCK_C)
        x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        y = x * scale[None, :] + shift[None, :]
        if HAS_Z:
            y += tl.load(z_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if RELU:
            y = tl.maximum(y, 0.0)
        tl.store(y_ptr + off, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_act(dy_ptr, x_ptr, z_ptr, off, mask, scale, shift, HAS_Z: tl.constexpr, RELU: tl.constexpr):
    x = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(dy_ptr + off, mask=mask, other=0.0).to(tl.float32)
    if RELU:
        pre = x * scale[None, :] + shift[None, :]
        if HAS_Z:
            pre += tl.load(z_ptr + off, mask=mask, other=0.0).to(tl.float32)
        d = tl.where(pre > 0, d, 0.0)
    return x, d


@triton.jit
def _backward_reduce_kernel(dy_ptr, x_ptr, z_ptr, st_ptr, ws_ptr, C, L, R, ITERS, HAS_Z: tl.constexpr,
                            RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
    rows = tl.num_programs(1)
    mean = tl.load(st_ptr + c, mask=cmask, other=0.0)
    scale = tl.load(st_ptr + 2 * C + c, mask=cmask, other=0.0)
    shift = tl.load(st_ptr + 3 * C + c, mask=cmask, other=0.0)
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for it in range(ITERS):
        off, mask = _tile(pc, pr, it, C, L, R, ITERS, BLOCK_R, BLOCK_C)
        x, d = _grad_act(dy_ptr, x_ptr, z_ptr, off, mask, scale, shift, HAS_Z, RELU)
        acc1 += d
        acc2 += tl.where(mask, d * (x - mean[None, :]), 0.0)
    tl.store(ws_ptr + (2 + pr) * C + c, tl.sum(acc1, axis=0), mask=cmask)
    tl.store(ws_ptr + (2 + rows + pr) * C + c, tl.sum(acc2, axis=0), mask=cmask)


@triton.jit
def _backward_elemt_kernel(dy_ptr, x_ptr, z_ptr, dx_ptr, dz_ptr, st_ptr, sums_ptr, count, C, L, R, ITERS,
                           HAS_Z: tl.constexpr, RELU: tl.constexpr, NEED_DZ: tl.constexpr, USE_SUMS: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
    mean = tl.load(st_ptr + c, mask=cmask, other=0.0)
    scale = tl.load(st_ptr + 2 * C + c, mask=cmask, other=0.0)
    shift = tl.load(st_ptr + 3 * C + c, mask=cmask, other=0.0)
    if USE_SUMS:
        # The group's means of Σ dy' and Σ dy' (x - mean): a few per-channel operations in each program
        # instead of operators (and launches) on the host.
        invstd = tl.load(st_ptr + C + c, mask=cmask, other=0.0)
        mdy = tl.div_rn(tl.load(sums_ptr + c, mask=cmask, other=0.0), count)
        k = tl.div_rn(tl.load(sums_ptr + C + c, mask=cmask, other=0.0), count) * invstd * invstd
    else:  # normalised with running statistics: the batch does not enter the statistics
        mdy = tl.zeros([BLOCK_C], dtype=tl.float32)
        k = tl.zeros([BLOCK_C], dtype=tl.float32)
    for it in range(ITERS):
        off, mask = _tile(pc, pr, it, C, L, R, ITERS, BLOCK_R, BLOCK_C)
        x, d = _grad_act(dy_ptr, x_ptr, z_ptr, off, mask, scale, shift, HAS_Z, RELU)
        dx = (d - mdy[None, :] - (x - mean[None, :]) * k[None, :]) * scale[None, :]
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DZ:
            tl.store(dz_ptr + off, d.to(dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_rows(ptr, c, cmask, C, ROWS, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Σ over the ``ROWS`` rows of an fp32 ``[ROWS, C]`` array, channels ``c``, in a fixed order."""
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, ROWS, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(ptr + p[:, None] * C + c[None, :], mask=(p < ROWS)[:, None] & cmask[None, :], other=0.0)
    return tl.sum(acc, axis=0)


# _finish_kernel's MODE: where the statistics come from (and where they go).
_LOCAL, _SEND, _MERGE, _EVAL = 0, 1, 2, 3


@triton.jit
def _finish_kernel(ws_ptr, gat_ptr, w_ptr, b_ptr, rm_ptr, rv_ptr, out_ptr, nbt_ptr, C, ROWS, R, WORLD, count, keep,
                   momentum, unbias, eps, MODE: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
                   UPDATE: tl.constexpr, COUNT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    if COUNT:  # the module's num_batches_tracked += 1, by the first lane of the first program (no operator)
        first = c == 0
        tl.store(nbt_ptr + c * 0, tl.load(nbt_ptr + c * 0, mask=first, other=0) + 1, mask=first)
    if MODE == 3:  # eval: the running statistics
        mean = tl.load(rm_ptr + c, mask=cmask, other=0.0).to(tl.float32)
        var = tl.load(rv_ptr + c, mask=cmask, other=0.0).to(tl.float32)
    elif MODE == 2:
        # Parallel Welford merge of the gathered fp64 rows [n_i, mean_i (C), var_i (C)], in fp64 and in rank
        # order: exact for unequal per-rank counts.
        stride = 1 + 2 * C
        n = tl.zeros([BLOCK_C], dtype=tl.float64)
        sm = tl.zeros([BLOCK_C], dtype=tl.float64)
        for w in range(WORLD):
            n_i = tl.load(gat_ptr + w * stride)
            n += n_i
            sm += n_i * tl.load(gat_ptr + w * stride + 1 + c, mask=cmask, other=0.0)
        gmean = sm / n
        sv = tl.zeros([BLOCK_C], dtype=tl.float64)
        for w in range(WORLD):
            n_i = tl.load(gat_ptr + w * stride)
            d = tl.load(gat_ptr + w * stride + 1 + c, mask=cmask, other=0.0) - gmean
            sv += n_i * (tl.load(gat_ptr + w * stride + 1 + C + c, mask=cmask, other=0.0) + d * d)
        mean = gmean.to(tl.float32)
        var = (sv / n).to(tl.float32)
    else:
        # The shifted sums Σ(x - x0), Σ(x - x0)² of the partial rows: mean = x0 + m1, var = m2 - m1².
        m1 = tl.div_rn(_sum_rows(ws_ptr + C, c, cmask, C, ROWS, BLOCK_P, BLOCK_C), R)
        m2 = tl.div_rn(_sum_rows(ws_ptr + (1 + ROWS) * C, c, cmask, C, ROWS, BLOCK_P, BLOCK_C), R)
        var = tl.maximum(m2 - m1 * m1, 0.0)
        mean = tl.load(ws_ptr + c, mask=cmask, other=0.0) + m1
    if MODE == 1:  # this rank's row of the all-gather: [count, mean, var] in fp64
        tl.store(out_ptr + c * 0, (c * 0 + count).to(tl.float64), mask=c == 0)
        tl.store(out_ptr + 1 + c, mean.to(tl.float64), mask=cmask)
        tl.store(out_ptr + 1 + C + c, var.to(tl.float64), mask=cmask)
    else:
        # Correctly rounded 1/sqrt (rsqrt.approx would differ from PyTorch's by an ulp or two).
        invstd = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        scale = invstd
        if HAS_W:
            scale = tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32) * invstd
        shift = -mean * scale
        if HAS_B:
            shift = tl.load(b_ptr + c, mask=cmask, other=0.0).to(tl.float32) - mean * scale
        tl.store(out_ptr + c, mean, mask=cmask)
        tl.store(out_ptr + C + c, invstd, mask=cmask)
        tl.store(out_ptr + 2 * C + c, scale, mask=cmask)
        tl.store(out_ptr + 3 * C + c, shift, mask=cmask)
        if UPDATE:  # running statistics, in place: momentum-weighted, unbiased variance
            rm = tl.load(rm_ptr + c, mask=cmask, other=0.0)
            rv = tl.load(rv_ptr + c, mask=cmask, other=0.0)
            new_m = rm.to(tl.float32) * keep + mean * momentum
            new_v = rv.to(tl.float32) * keep + (var * unbias) * momentum
            tl.store(rm_ptr + c, new_m.to(rm.dtype), mask=cmask)
            tl.store(rv_ptr + c, new_v.to(rv.dtype), mask=cmask)


@triton.jit
def _backward_finish_kernel(ws_ptr, st_ptr, gw_ptr, gb_ptr, C, ROWS, HAS_GW: tl.constexpr, HAS_GB: tl.constexpr,
                            BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = c < C
    sum_dy = _sum_rows(ws_ptr + 2 * C, c, cmask, C, ROWS, BLOCK_P, BLOCK_C)
    sum_dy_xmu = _sum_rows(ws_ptr + (2 + ROWS) * C, c, cmask, C, ROWS, BLOCK_P, BLOCK_C)
    tl.store(ws_ptr + c, sum_dy, mask=cmask)
    tl.store(ws_ptr + C + c, sum_dy_xmu, mask=cmask)
    if HAS_GW:
        gw = sum_dy_xmu * tl.load(st_ptr + C + c, mask=cmask, other=0.0)
        tl.store(gw_ptr + c, gw.to(gw_ptr.dtype.element_ty), mask=cmask)
    if HAS_GB:
        tl.store(gb_ptr + c, sum_dy.to(gb_ptr.dtype.element_ty), mask=cmask)


_F32 = torch.float32


class Plan:
    """The launches of one ``[N, C, L]`` size: its layout, workspaces and each kernel bound to its grid
    (``kernel[grid]`` builds that closure at every call otherwise). Each kernel's argument list is written
    once, in a method below; the launchers of this module and ``apex.ops._syncbn_direct`` (which keeps the
    plan of an input shape) both launch through them. The launches pass their constexprs positionally, in each
    kernel's order (a keyword costs a launch a dictionary entry to build and bind, ~2,000 instructions each)."""

    __slots__ = ("C", "L", "R", "Rf", "rows", "iters", "br", "bc", "bp", "fbc", "ws_fwd", "ws_bwd", "_stats",
                 "_finish", "_forward", "_reduce", "_reduce_finish", "_elemt")

    def __init__(self, N: int, C: int, L: int):
        # The interpreter pays per op, not per element: few large tiles. ``rows`` of programs, ``iters`` tiles each.
        R = N * L
        bc = min(next_power_of_2(C), 32 if L == 1 else 4)
        br = max(16, min(next_power_of_2(R), (4096 if _INTERP else 2048) // bc))
        tiles = cdiv(R, br)
        iters = cdiv(tiles, min(tiles, 4 if _INTERP else 256))
        rows = cdiv(tiles, iters)
        self.C, self.L, self.R, self.Rf, self.rows, self.iters = C, L, R, float(R), rows, iters
        self.br, self.bc = br, bc
        # The per-channel kernels: a tile of at most 2048 partials a program, 32 channels (128-byte rows) a program
        # on a GPU so that wide layers spread over several SMs.
        self.fbc = fbc = min(next_power_of_2(C), 128 if _INTERP else 32)
        self.bp = max(1, min(next_power_of_2(rows), 2048 // fbc))
        self.ws_fwd, self.ws_bwd = 1 + 2 * rows, 2 + 2 * rows
        grid, fgrid = (cdiv(C, bc), rows), (cdiv(C, fbc),)
        self._stats, self._finish, self._forward = _stats_kernel[grid], _finish_kernel[fgrid], _forward_kernel[grid]
        self._reduce, self._reduce_finish = _backward_reduce_kernel[grid], _backward_finish_kernel[fgrid]
        self._elemt = _backward_elemt_kernel[grid]

    def stats(self, x: torch.Tensor) -> torch.Tensor:
        """The forward's workspace ``[1 + 2P, C]`` after the statistics kernel."""
        # fp32 on x's device: no device argument to parse (~1.3k instructions), nor a dtype for fp32 (~0.5 µs)
        ws = x.new_empty(self.ws_fwd, self.C) if x.dtype is _F32 else x.new_empty(self.ws_fwd, self.C, dtype=_F32)
        self._stats(x, ws, self.C, self.L, self.R, self.iters, self.br, self.bc)  # BLOCK_R, BLOCK_C
        return ws

    def finish(self, ws, out, weight, bias, running_mean, running_var, tracked, eps: float, momentum: float,
               mode: int = _LOCAL, gat=None, count=None) -> None:
        """``_finish_kernel``: this size's partial rows ``ws`` to ``st`` (``out``, mode ``_LOCAL``) or to this
        rank's fp64 row (``_SEND``); the rows ``gat`` gathered from the ranks, ``count`` values in all, to ``st``
        (``_MERGE``); on the plan of one row (:func:`eval_stats`), the running statistics to ``st`` (``_EVAL``).
        The running statistics are updated with ``momentum > 0`` (not in eval), ``tracked`` incremented (or
        None)."""
        if count is None:
            count = self.R
        world = 1 if gat is None else gat.shape[0]
        unbias = count / (count - 1) if mode == _LOCAL or mode == _MERGE else 1.0
        update = running_mean is not None and momentum > 0
        if not update and mode != _EVAL:
            running_mean = running_var = ws
        self._finish(ws, ws if gat is None else gat, weight if weight is not None else ws,
                     bias if bias is not None else ws, running_mean, running_var, out,
                     tracked if tracked is not None else ws, self.C, self.rows, self.Rf, world, count, 1.0 - momentum,
                     momentum, unbias, eps, mode, weight is not None, bias is not None, update, tracked is not None,
                     self.bp, self.fbc)  # (MODE, HAS_W, HAS_B, UPDATE, COUNT, BLOCK_P, BLOCK_C)

    def train_stats(self, x: torch.Tensor, weight, bias, running_mean, running_var, eps: float, momentum: float,
                    gather=None, tracked=None) -> tuple[int, torch.Tensor]:
        """:func:`train_stats` on this size."""
        ws = self.stats(x)
        if gather is None:
            st = ws.new_empty(4, self.C)
            self.finish(ws, st, weight, bias, running_mean, running_var, tracked, eps, momentum)
            return self.R, st
        row = torch.empty(1 + 2 * self.C, dtype=torch.float64, device=x.device)
        self.finish(ws, row, None, None, None, None, None, 0.0, 0.0, _SEND)
        gat, count = gather(row)
        st = ws.new_empty(4, self.C)
        self.finish(ws, st, weight, bias, running_mean, running_var, tracked, eps, momentum, _MERGE, gat, count)
        return count, st

    def normalize(self, x: torch.Tensor, z, st: torch.Tensor, fuse_relu: bool) -> torch.Tensor:
        """:func:`normalize` on this size (``fuse_relu`` a bool)."""
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._forward(x, z if z is not None else x, y, st, self.C, self.L, self.R, self.iters, z is not None,
                      fuse_relu, self.br, self.bc)  # HAS_Z, RELU, BLOCK_R, BLOCK_C
        return y

    def backward_sums(self, dy, x: torch.Tensor, z, st, fuse_relu: bool, grad_weight, grad_bias) -> torch.Tensor:
        """:func:`backward_sums` on this size (``fuse_relu`` a bool)."""
        ws = st.new_empty(self.ws_bwd, self.C)  # (fp32 on x's device like st: no dtype or device to parse)
        self._reduce(dy, x, z if z is not None else x, st, ws, self.C, self.L, self.R, self.iters, z is not None,
                     fuse_relu, self.br, self.bc)  # HAS_Z, RELU, BLOCK_R, BLOCK_C
        self._reduce_finish(ws, st, grad_weight if grad_weight is not None else ws,
                            grad_bias if grad_bias is not None else ws, self.C, self.rows, grad_weight is not None,
                            grad_bias is not None, self.bp, self.fbc)  # HAS_GW, HAS_GB, BLOCK_P, BLOCK_C
        return ws

    def backward_elemt(self, dy, x: torch.Tensor, z, st, sums, count, fuse_relu: bool, need_dz: bool):
        """:func:`backward_elemt_sums` on this size (``fuse_relu`` and ``need_dz`` bools)."""
        dx = torch.empty_like(x, memory_format=torch.contiguous_format)
        dz = torch.empty_like(dx) if need_dz else dx
        self._elemt(dy, x, z if z is not None else x, dx, dz, st, sums if sums is not None else st,
                    float(count or 1), self.C, self.L, self.R, self.iters, z is not None, fuse_relu, need_dz,
                    count is not None, self.br, self.bc)  # HAS_Z, RELU, NEED_DZ, USE_SUMS, BLOCK_R, BLOCK_C
        return dx, (dz if need_dz else None)


_PLANS: dict = {}


def plan(ncl: tuple[int, int, int]) -> Plan:
    """The :class:`Plan` of the ``(N, C, L)`` size, cached: a training step asks four times, and a model has few
    distinct sizes."""
    hit = _PLANS.get(ncl)
    if hit is None:
        if len(_PLANS) >= 1024:  # sizes that keep changing (variable batch or resolution): stay bounded
            _PLANS.clear()
        hit = _PLANS[ncl] = Plan(*ncl)
    return hit


def train_stats(x: torch.Tensor, ncl: tuple[int, int, int], weight, bias, running_mean, running_var, eps: float,
                momentum: float, gather=None, num_batches_tracked=None) -> tuple[int, torch.Tensor]:
    """``(count, st)`` of a training step on the contiguous ``x`` viewed as ``ncl = (N, C, L)``, the running
    statistics updated in place (with ``momentum > 0``). ``gather``: with ranks, a callable taking this
    rank's fp64 row ``[count, mean (C), var (C)]`` and returning ``(rows of every rank [world, 1 + 2C],
    total count)``; None for the local batch. ``num_batches_tracked``: an integer tensor incremented by one in
    the kernel (or None)."""
    return plan(ncl).train_stats(x, weight, bias, running_mean, running_var, eps, momentum, gather,
                                 num_batches_tracked)


def eval_stats(C: int, weight, bias, running_mean, running_var, eps: float) -> torch.Tensor:
    """``st`` from the running statistics (the finishing kernel laid out for one row: the plan of ``(1, C, 1)``)."""
    st = running_mean.new_empty(4, C, dtype=_F32)
    plan((1, C, 1)).finish(st, st, weight, bias, running_mean, running_var, None, eps, 0.0, _EVAL)
    return st


def normalize(x: torch.Tensor, ncl: tuple[int, int, int], st: torch.Tensor, z, fuse_relu: bool) -> torch.Tensor:
    """``y = x * scale + shift (+ z)`` (relu), shaped like ``x``."""
    return plan(ncl).normalize(x, z, st, bool(fuse_relu))


def backward_sums(dy, x, ncl: tuple[int, int, int], st, z, fuse_relu: bool, grad_weight=None,
                  grad_bias=None) -> torch.Tensor:
    """The backward's workspace, whose first ``2 * C`` values are ``[Σ dy', Σ dy' (x - mean)]``; writes
    ``grad_weight = Σ dy' (x - mean) * invstd`` and ``grad_bias = Σ dy'`` into the given tensors."""
    return plan(ncl).backward_sums(dy, x, z, st, bool(fuse_relu), grad_weight, grad_bias)


def backward_elemt_sums(dy, x, ncl: tuple[int, int, int], st, sums, count, z, fuse_relu: bool, need_dz: bool):
    """``(dx, dz)`` shaped like ``x`` with ``mean_dy, mean_dy_xmu = sums[:C] / count, sums[C:2C] / count``
    (``count`` None: both zero, as when normalising with running statistics)."""
    return plan(ncl).backward_elemt(dy, x, z, st, sums, count, bool(fuse_relu), bool(need_dz))


# ------------------------------------------- the building blocks of apex.ops.sync_batch_norm on [N, C, L] views
def _st(mean, invstd, scale, shift) -> torch.Tensor:
    """An ``st`` buffer from separate per-channel vectors (a row a kernel does not read may repeat another)."""
    return torch.stack([mean, invstd, scale, shift]).float()


def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(mean, biased var)`` in fp32."""
    p = plan(tuple(x.shape))
    C = p.C
    row = torch.empty(1 + 2 * C, dtype=torch.float64, device=x.device)  # [count, mean, var], exact fp32 values
    p.finish(p.stats(x), row, None, None, None, None, None, 0.0, 0.0, _SEND)
    return row[1:1 + C].float(), row[1 + C:].float()


def forward(x, scale, shift, z, fuse_relu: bool) -> torch.Tensor:
    return normalize(x, tuple(x.shape), _st(scale, scale, scale, shift), z, fuse_relu)


def backward_reduce(dy, x, mean, scale, shift, z, fuse_relu: bool):
    ws = backward_sums(dy, x, tuple(x.shape), _st(mean, mean, scale, shift), z, fuse_relu)
    return ws[0], ws[1]


def backward_elemt(dy, x, mean, invstd, scale, shift, mean_dy, mean_dy_xmu, z, fuse_relu: bool,
                   need_dz: bool):
    sums = torch.stack([mean_dy, mean_dy_xmu]).float()  # the means as sums over a count of one
    return backward_elemt_sums(dy, x, tuple(x.shape), _st(mean, invstd, scale, shift), sums, 1, z, fuse_relu,
                               need_dz)
