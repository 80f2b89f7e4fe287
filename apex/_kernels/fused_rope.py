"""Rotary positional embedding (rotate-half RoPE), forward and backward in one launch each.

The input is a strided 4-D view ``[S, B, H, D]`` (``sbhd``; ``thd`` is ``[T, 1, H, D]``; the 2-D image
variant is ``[s, b, h, d]`` from the caller's ``[b, s, h, d]``). Each program owns one ``(s, b)`` row and
a block of heads and writes that output tile once. For the rotary columns ``j < R`` of a segment, with
``half = R / 2`` and ``p(j)`` the column in the other half:

* forward:  ``y_j = x_j cos_j + sign_j x_p(j) sin_j``      (sign −1 in the first half, +1 in the second)
* backward: ``dx_j = dy_j cos_j − sign_j dy_p(j) sin_p(j)`` (the transpose of the forward rotation)

Columns past the rotary part pass through. Two tiles compute this. The full tile (``_rope_tile``, every
mode) loads ``[heads, D]`` of ``x`` and the partner half as a second load of the same addresses (a cache
hit), and takes the tables over all ``D`` columns. The half tiles (``_rope_halves``, modes 0-2, chosen by
the configuration key ``halves``) load ``x1 = x[:, :half]`` and ``x2 = x[:, half:R]`` once each, the
tables' columns once per program for the whole head block, and copy the columns ``[R, D)``:
``y1 = x1 c1 − x2 s1, y2 = x2 c2 + x1 s2`` forward and ``dx1 = dy1 c1 + dy2 s2, dx2 = dy2 c2 − dy1 s1``
backward (``c1, s1``: the tables at the first half's columns, ``c2, s2`` at the second's), the same
values bit for bit (in fp32 the compiler fuses the same product, ``x_j cos_j``, into an FMA in both).

Arithmetic in fp32, one rounding to the output dtype; for fp16/bf16 (``ROUND``) the tables and each product
are rounded to that dtype first, reproducing upstream's kernel (and its unfused PyTorch formula) bit for
bit. Measure that under the interpreter only with ``apex.testing.prepare_interpreter()``: the bare
interpreter truncates each of those five fp32 -> bf16 roundings (a GPU rounds to nearest even), which shows
as about 4.7x the once-rounded formula's error instead of the kernel's 1.65x.

Modes (constexpr): 0 ``freqs`` (cos/sin computed from the fp32 angles), 1 cached ``cos``/``sin`` tables,
2 ``thd`` with ``freqs`` (the position of token ``s`` is ``s − cu_seqlens[k]`` for its sequence ``k``,
found by comparing against all of ``cu_seqlens``; tokens outside ``[cu[0], cu[-1])`` pass through),
3 the 2-D image variant: two segments of ``R = D / 2`` columns, the first rotated by ``(cos_h, sin_h)``
at row ``s // img_w``, the second by ``(cos_w, sin_w)`` at row ``s % img_w``.

``R`` is a compile-time constant (a compile per rotary width, as a model has one): the half tiles' block
sizes (``R / 2`` and the pass-through columns) follow from it in the kernel, not from the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _sequence(CU, n_cu, s, BLOCK_CU: tl.constexpr):
    """(start, first token, end) of the ``cu_seqlens`` sequence holding token ``s`` (mode 2): its index is the
    number of ``cu_seqlens[1:]`` entries <= s."""
    k = tl.arange(0, BLOCK_CU)
    cu = tl.load(CU + k, mask=k < n_cu, other=0).to(tl.int64)
    lo = tl.load(CU).to(tl.int64)
    hi = tl.load(CU + n_cu - 1).to(tl.int64)
    seq = tl.sum(((k >= 1) & (k < n_cu) & (cu <= s)).to(tl.int32), axis=0)
    return tl.load(CU + seq).to(tl.int64), lo, hi


@triton.jit
def _rope_tile(X, Y, TA, TB, TC, TD, CU, B, H, D, R: tl.constexpr, n_cu, img_w,
               xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
               ta_r, ta_c, tb_r, tb_c, tc_r, tc_c, td_r, td_c,
               MODE: tl.constexpr, BACKWARD: tl.constexpr, ROUND: tl.constexpr,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CU: tl.constexpr):
    row = tl.program_id(0)
    s = row // B
    b = row % B
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (hh < H) & (d < D)
    x_row = X + s.to(tl.int64) * xs_s + b.to(tl.int64) * xs_b
    x = tl.load(x_row + hh * xs_h + d * xs_d, mask=mask, other=0.0).to(tl.float32)

    if MODE == 3:
        seg = d // R
        col = d - seg * R
        rot = d < 2 * R
    else:
        seg = d * 0
        col = d
        rot = d < R
    half = R // 2
    first = col < half
    pcol = tl.where(first, col + half, col - half)

    if MODE == 2:
        # Rows outside every sequence pass through.
        start, lo, hi = _sequence(CU, n_cu, s, BLOCK_CU)
        sb = d * 0 + s  # as a block: a scalar mask does not combine with block masks in the interpreter
        rot = rot & (sb >= lo) & (sb < hi)
        pos = s - start
    elif MODE == 3:
        pos = tl.where(seg == 0, s // img_w, s % img_w)
    else:
        pos = s
    tmask = rot & (d < D)
    scol = pcol if BACKWARD else col

    if MODE == 0 or MODE == 2:
        c = tl.cos(tl.load(TA + pos * ta_r + col * ta_c, mask=tmask, other=0.0).to(tl.float32))
        sn = tl.sin(tl.load(TA + pos * ta_r + scol * ta_c, mask=tmask, other=0.0).to(tl.float32))
    elif MODE == 1:
        c = tl.load(TA + pos * ta_r + col * ta_c, mask=tmask, other=1.0).to(tl.float32)
        sn = tl.load(TB + pos * tb_r + scol * tb_c, mask=tmask, other=0.0).to(tl.float32)
    else:
        m0 = tmask & (seg == 0)
        m1 = tmask & (seg == 1)
        c = tl.where(seg == 0, tl.load(TA + pos * ta_r + col * ta_c, mask=m0, other=1.0).to(tl.float32),
                     tl.load(TC + pos * tc_r + col * tc_c, mask=m1, other=1.0).to(tl.float32))
        sn = tl.where(seg == 0, tl.load(TB + pos * tb_r + scol * tb_c, mask=m0, other=0.0).to(tl.float32),
                      tl.load(TD + pos * td_r + scol * td_c, mask=m1, other=0.0).to(tl.float32))

    xp = tl.load(x_row + hh * xs_h + (pcol + seg * R) * xs_d, mask=mask & rot, other=0.0).to(tl.float32)
    if BACKWARD:
        sign = tl.where(first, 1.0, -1.0)
    else:
        sign = tl.where(first, -1.0, 1.0)
    if ROUND:  # fp16/bf16: the tables and each product rounded to the dtype, as upstream's kernel
        dt = Y.dtype.element_ty
        c = c.to(dt).to(tl.float32)
        sn = sn.to(dt).to(tl.float32)
        y = tl.where(rot, (x * c).to(dt).to(tl.float32) + sign * (xp * sn).to(dt).to(tl.float32), x)
    else:
        y = tl.where(rot, x * c + sign * xp * sn, x)
    y_row = Y + s.to(tl.int64) * ys_s + b.to(tl.int64) * ys_b
    tl.store(y_row + hh * ys_h + d * ys_d, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rope_halves(X, Y, TA, TB, CU, B, H, D, R: tl.constexpr, n_cu, xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
                 ta_r, ta_c, tb_r, tb_c, MODE: tl.constexpr, BACKWARD: tl.constexpr, ROUND: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CU: tl.constexpr, HALVES: tl.constexpr):
    # Modes 0-2 on two half tiles, x1 = x[:, :R/2] and x2 = x[:, R/2:R]: each element loaded once, the
    # tables' columns loaded (cos/sin computed) once per program and shared by the head block, the columns
    # [R, D) copied apart. The same values, bit for bit, as _rope_tile's y_j and y_(j+R/2): its
    # x_j c_j + (-1)(x_p(j) s_j) is x_j c_j - x_p(j) s_j, rounded the same.
    BLOCK_R2: tl.constexpr = triton.next_power_of_2(R // 2)  # a half's columns
    BLOCK_P: tl.constexpr = triton.next_power_of_2(BLOCK_D - R)  # the pass-through columns, D - R at most
    # The angles' [R/2, 2] tile taken often enough to hold an element a thread: HALVES is half the threads.
    COPIES: tl.constexpr = max(1, HALVES // max(1, BLOCK_R2))
    row = tl.program_id(0)
    s = row // B
    b = row % B
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    hm = hh < H
    x_row = X + s.to(tl.int64) * xs_s + b.to(tl.int64) * xs_b + hh * xs_h
    y_row = Y + s.to(tl.int64) * ys_s + b.to(tl.int64) * ys_b + hh * ys_h
    if BLOCK_R2 > 0:
        half = R // 2
        j = tl.arange(0, BLOCK_R2)[None, :]  # a half's columns, along the head tile's rows
        jt = tl.arange(0, BLOCK_R2)[:, None]  # the same down the angles' [R/2, 2] tile
        tm = j < half
        # x before the tables, as _rope_tile: LLVM orders a sum's two products by when their operands are ready
        # and fuses the first into an FMA, so in fp32 that is each output's own product (x1·c1, x2·c2, the
        # partner's rounded), as there; x2 loaded after the tables made y2 fuse x1·s2 instead (other bits).
        m = hm & tm
        x1 = tl.load(x_row + j * xs_d, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(x_row + (j + half) * xs_d, mask=m, other=0.0).to(tl.float32)
        fm = jt < half
        if MODE == 2:
            # Rows outside every sequence pass through.
            start, lo, hi = _sequence(CU, n_cu, s, BLOCK_CU)
            # As blocks: a scalar mask does not combine with block masks in the interpreter.
            inside = (j * 0 + s >= lo) & (j * 0 + s < hi)
            tm = tm & inside
            fm = fm & (jt * 0 + s >= lo) & (jt * 0 + s < hi)
            pos = s - start
        else:
            pos = s
        if MODE == 1:
            c1 = tl.load(TA + pos * ta_r + j * ta_c, mask=tm, other=1.0).to(tl.float32)
            c2 = tl.load(TA + pos * ta_r + (j + half) * ta_c, mask=tm, other=1.0).to(tl.float32)
            s1 = tl.load(TB + pos * tb_r + j * tb_c, mask=tm, other=0.0).to(tl.float32)
            s2 = tl.load(TB + pos * tb_r + (j + half) * tb_c, mask=tm, other=0.0).to(tl.float32)
        else:
            # Both halves' angles as one [R/2, 2] tile (column i: half i), split after cos/sin, and taken
            # COPIES times (the copies masked, dropped by an exact sum with -0.0) so that the tile has at
            # least as many elements as the program has threads: a smaller load counts as cheap to the
            # compiler, which then recomputes cos/sin in the head tile's layout (each thread all of its
            # columns' angles) instead of spreading them over the threads (about one each) and exchanging.
            fc = jt + tl.arange(0, 2)[None, :] * half
            if COPIES == 1:
                f = tl.load(TA + pos * ta_r + fc * ta_c, mask=fm, other=0.0).to(tl.float32)
                c = tl.cos(f)
                sn = tl.sin(f)
            else:
                first = tl.arange(0, COPIES)[None, None, :] == 0
                f = tl.load(TA + pos * ta_r + (fc[:, :, None] + first * 0) * ta_c, mask=fm[:, :, None] & first,
                            other=0.0).to(tl.float32)
                c = tl.sum(tl.where(first, tl.cos(f), -0.0), axis=2)
                sn = tl.sum(tl.where(first, tl.sin(f), -0.0), axis=2)
            c1, c2 = tl.split(c)
            s1, s2 = tl.split(sn)
            c1 = c1[None, :]
            c2 = c2[None, :]
            s1 = s1[None, :]
            s2 = s2[None, :]
        if ROUND:  # fp16/bf16: the tables and each product rounded to the dtype, as upstream's kernel
            dt = Y.dtype.element_ty
            c1 = c1.to(dt).to(tl.float32)
            s1 = s1.to(dt).to(tl.float32)
            c2 = c2.to(dt).to(tl.float32)
            s2 = s2.to(dt).to(tl.float32)
            if BACKWARD:
                y1 = (x1 * c1).to(dt).to(tl.float32) + (x2 * s2).to(dt).to(tl.float32)
                y2 = (x2 * c2).to(dt).to(tl.float32) - (x1 * s1).to(dt).to(tl.float32)
            else:
                y1 = (x1 * c1).to(dt).to(tl.float32) - (x2 * s1).to(dt).to(tl.float32)
                y2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        elif BACKWARD:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        if MODE == 2:
            y1 = tl.where(inside, y1, x1)
            y2 = tl.where(inside, y2, x2)
        tl.store(y_row + j * ys_d, y1.to(Y.dtype.element_ty), mask=m)
        tl.store(y_row + (j + half) * ys_d, y2.to(Y.dtype.element_ty), mask=m)
    if BLOCK_P > 0:  # the columns past the rotary part (x and y have one dtype): a copy
        cols = R + tl.arange(0, BLOCK_P)[None, :]
        pm = hm & (cols < D)
        tl.store(y_row + cols * ys_d, tl.load(x_row + cols * xs_d, mask=pm), mask=pm)


@triton.jit
def _rope_kernel(X, Y, TA, TB, TC, TD, CU, B, H, D, R: tl.constexpr, n_cu, img_w,
                 xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
                 ta_r, ta_c, tb_r, tb_c, tc_r, tc_c, td_r, td_c,
                 MODE: tl.constexpr, BACKWARD: tl.constexpr, ROUND: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CU: tl.constexpr, HALVES: tl.constexpr):
    # HALVES: 0 for _rope_tile, else _rope_halves (16 x the warps: half the program's threads). Mode 3 always
    # takes _rope_tile: two segments, each with its own tables.
    if HALVES and MODE != 3:
        _rope_halves(X, Y, TA, TB, CU, B, H, D, R, n_cu, xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
                     ta_r, ta_c, tb_r, tb_c, MODE, BACKWARD, ROUND, BLOCK_H, BLOCK_D, BLOCK_CU, HALVES)
    else:
        _rope_tile(X, Y, TA, TB, TC, TD, CU, B, H, D, R, n_cu, img_w, xs_s, xs_b, xs_h, xs_d,
                   ys_s, ys_b, ys_h, ys_d, ta_r, ta_c, tb_r, tb_c, tc_r, tc_c, td_r, td_c,
                   MODE, BACKWARD, ROUND, BLOCK_H, BLOCK_D, BLOCK_CU)


@triton.jit
def _rope_freqs_kernel(X, Y, TA, B, H, D, R: tl.constexpr, xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d, ta_r,
                       ta_c, BACKWARD: tl.constexpr, ROUND: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr, HALVES: tl.constexpr):
    # Mode 0 (one table of angles, no offsets): the usual call, with 16 tensor and integer arguments instead of
    # 28 (a launch binds each argument on the host).
    if HALVES:
        _rope_halves(X, Y, TA, TA, TA, B, H, D, R, 1, xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
                     ta_r, ta_c, 0, 0, 0, BACKWARD, ROUND, BLOCK_H, BLOCK_D, 2, HALVES)
    else:
        _rope_tile(X, Y, TA, TA, TA, TA, TA, B, H, D, R, 1, 1, xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
                   ta_r, ta_c, 0, 0, 0, 0, 0, 0, 0, BACKWARD, ROUND, BLOCK_H, BLOCK_D, 2)


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_rope_kernel)


_ROUNDED = (torch.float16, torch.bfloat16)


def _strides2(t: torch.Tensor | None, dims: tuple[int, int]) -> tuple[int, int]:
    if t is None:
        return _NO_STRIDES
    # One stride() tuple indexed twice: stride(dim) parses its overloads (int or name) on every call.
    s = t.stride()
    return (s[dims[0]], s[dims[1]])


# (x's shape [S, B, H, D], dtype, device index, backward) -> (the grid's launchers of both kernels, B, H, D, head
# block, head-dim block, warps, ROUND, HALVES, empty, the picked configuration): the launch a shape takes
# (kernel[grid] builds a new launcher at every call), keyed by the torch.Size itself (no unpacking, no
# element_size query).
_PLANS = _tuning.plan_cache()


def _plan(x: torch.Tensor, backward: bool) -> tuple:
    key = (x.shape, x.dtype, x.get_device(), backward)
    p = _PLANS.get(key)
    op = "fused_rope.bwd" if backward else "fused_rope.fwd"
    if p is None:
        S, B, H, D = key[0]
        sb = S * B
        block_d = next_power_of_2(D)
        # Interpreted programs cost per program: bigger head blocks there, GPU-sized tiles otherwise.
        cap = 16384 if _INTERP else 4096
        # halves (modes 0-2): each element loaded once and each column's cos/sin once per program, where the
        # full tile loads the rotary columns twice (the partner half) and takes cos/sin over all D columns.
        # Compiled for sm_90 (bf16, 32 heads of 128) it has fewer loads, instructions and registers at every
        # head block and warp count of the sweep but the single-head, single-warp one (the same there, give or
        # take a few). Measured entries without the key (timed on the full tile) take it too, at their heads
        # and warps: the same tile with fewer loads and instructions (8 heads, 1 warp: 5 loads of 16 bytes a
        # thread instead of 9, 1,159 SASS instructions a warp instead of 1,739, 61 registers instead of 121).
        cfg = _tuning.pick(op, x.device, x.element_size(), (sb, H, D),
                           {"heads": max(1, min(next_power_of_2(H), cap // block_d)), "warps": 4, "halves": 1})
        grid = (sb, cdiv(H, cfg["heads"]))
        p = _PLANS[key] = (_rope_kernel[grid], _rope_freqs_kernel[grid], B, H, D, cfg["heads"], block_d,
                           cfg["warps"], x.dtype in _ROUNDED, 16 * cfg["warps"] if cfg["halves"] else 0,
                           sb * H * D == 0, cfg)
    else:
        _tuning.last[op] = p[11]  # as pick records it
    return p


_NO_STRIDES = (0, 0)  # an absent table's


def rope(x: torch.Tensor, y: torch.Tensor, mode: int, backward: bool, rot: int,
         ta: torch.Tensor, tb: torch.Tensor | None = None, tc: torch.Tensor | None = None,
         td: torch.Tensor | None = None, cu: torch.Tensor | None = None, img_w: int = 1,
         dims: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Write the rotation of ``x`` (a 4-D ``[S, B, H, D]`` view) into ``y`` (same logical shape).

    ``ta``..``td`` are the angle or cos/sin tables, read as ``[rows, cols]`` along their dimensions ``dims``
    (2-D views by default; the ops pass their 4-D tables and the two dimensions, which saves a view per table
    per call); ``cu`` the int ``cu_seqlens`` (mode 2).
    """
    launch, launch_freqs, B, H, D, BLOCK_H, BLOCK_D, warps, rounded, halves, empty, _ = _plan(x, backward)
    if empty:
        return y
    s = ta.stride()  # one tuple indexed twice: stride(dim) parses its overloads (int or name) on every call
    if mode == 0:
        launch_freqs(x, y, ta, B, H, D, rot, *x.stride(), *y.stride(), s[dims[0]], s[dims[1]],
                     backward, rounded, BLOCK_H, BLOCK_D, halves, num_warps=warps)
        return y
    if tb is None:  # one table (angles): the others' strides are constants, as are cu_seqlens' without it
        strides = (s[dims[0]], s[dims[1]], 0, 0, 0, 0, 0, 0)
        tb = tc = td = ta
    else:
        strides = (s[dims[0]], s[dims[1]], *_strides2(tb, dims), *_strides2(tc, dims), *_strides2(td, dims))
        tc, td = (tc if tc is not None else ta), (td if td is not None else ta)
    if cu is None:
        n_cu, block_cu, cu = 1, 2, ta
    else:
        n_cu = cu.numel()
        block_cu = next_power_of_2(max(n_cu, 2))
    launch(x, y, ta, tb, tc, td, cu, B, H, D, rot, n_cu, img_w, *x.stride(), *y.stride(), *strides,
           # The constexprs positionally (MODE, BACKWARD, ROUND, BLOCK_H, BLOCK_D, BLOCK_CU, HALVES): each
           # keyword costs a launch ~2,000 instructions of dictionary building and binding.
           mode, backward, rounded, BLOCK_H, BLOCK_D, block_cu, halves, num_warps=warps)
    return y
