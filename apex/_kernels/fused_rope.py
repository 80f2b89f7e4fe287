"""Rotary positional embedding (rotate-half RoPE), forward and backward in one launch each.

The input is a strided 4-D view ``[S, B, H, D]`` (``sbhd``; ``thd`` is ``[T, 1, H, D]``; the 2-D image
variant is ``[s, b, h, d]`` from the caller's ``[b, s, h, d]``). Each program owns one ``(s, b)`` row and
a block of heads, loads that tile of ``x`` once (the partner half of the rotary columns is a second load
of the same addresses, a cache hit) and writes the output tile once. For the rotary columns
``j < R`` of a segment, with ``half = R / 2`` and ``p(j)`` the column in the other half:

* forward:  ``y_j = x_j cos_j + sign_j x_p(j) sin_j``      (sign −1 in the first half, +1 in the second)
* backward: ``dx_j = dy_j cos_j − sign_j dy_p(j) sin_p(j)`` (the transpose of the forward rotation)

Columns past the rotary part pass through. Arithmetic in fp32, one rounding to the output dtype; for
fp16/bf16 (``ROUND``) the tables and each product are rounded to that dtype first, reproducing upstream's
kernel (and its unfused PyTorch formula) bit for bit. Measure that under the interpreter only with
``apex.testing.prepare_interpreter()``: the bare interpreter truncates each of those five fp32 -> bf16
roundings (a GPU rounds to nearest even), which shows as about 4.7x the once-rounded formula's error
instead of the kernel's 1.65x.

Modes (constexpr): 0 ``freqs`` (cos/sin computed from the fp32 angles), 1 cached ``cos``/``sin`` tables,
2 ``thd`` with ``freqs`` (the position of token ``s`` is ``s − cu_seqlens[k]`` for its sequence ``k``,
found by comparing against all of ``cu_seqlens``; tokens outside ``[cu[0], cu[-1])`` pass through),
3 the 2-D image variant: two segments of ``R = D / 2`` columns, the first rotated by ``(cos_h, sin_h)``
at row ``s // img_w``, the second by ``(cos_w, sin_w)`` at row ``s % img_w``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _rope_tile(X, Y, TA, TB, TC, TD, CU, B, H, D, R, n_cu, img_w,
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
        # Sequence of token s: the number of cu_seqlens[1:] entries <= s; rows outside pass through.
        k = tl.arange(0, BLOCK_CU)
        cu = tl.load(CU + k, mask=k < n_cu, other=0).to(tl.int64)
        lo = tl.load(CU).to(tl.int64)
        hi = tl.load(CU + n_cu - 1).to(tl.int64)
        seq = tl.sum(((k >= 1) & (k < n_cu) & (cu <= s)).to(tl.int32), axis=0)
        start = tl.load(CU + seq).to(tl.int64)
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
def _rope_kernel(X, Y, TA, TB, TC, TD, CU, B, H, D, R, n_cu, img_w,
                 xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
                 ta_r, ta_c, tb_r, tb_c, tc_r, tc_c, td_r, td_c,
                 MODE: tl.constexpr, BACKWARD: tl.constexpr, ROUND: tl.constexpr,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CU: tl.constexpr):
    _rope_tile(X, Y, TA, TB, TC, TD, CU, B, H, D, R, n_cu, img_w, xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d,
               ta_r, ta_c, tb_r, tb_c, tc_r, tc_c, td_r, td_c, MODE, BACKWARD, ROUND, BLOCK_H, BLOCK_D, BLOCK_CU)


@triton.jit
def _rope_freqs_kernel(X, Y, TA, B, H, D, R, xs_s, xs_b, xs_h, xs_d, ys_s, ys_b, ys_h, ys_d, ta_r, ta_c,
                       BACKWARD: tl.constexpr, ROUND: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    # Mode 0 (one table of angles, no offsets): the usual call, with 17 arguments instead of 29 (a launch
    # binds each argument on the host).
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
# block, head-dim block, warps, ROUND, empty, the picked configuration): the launch a shape takes (kernel[grid]
# builds a new launcher at every call), keyed by the torch.Size itself (no unpacking, no element_size query).
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
        cfg = _tuning.pick(op, x.device, x.element_size(), (sb, H, D),
                           {"heads": max(1, min(next_power_of_2(H), cap // block_d)), "warps": 4})
        grid = (sb, cdiv(H, cfg["heads"]))
        p = _PLANS[key] = (_rope_kernel[grid], _rope_freqs_kernel[grid], B, H, D, cfg["heads"], block_d,
                           cfg["warps"], x.dtype in _ROUNDED, sb * H * D == 0, cfg)
    else:
        _tuning.last[op] = p[10]  # as pick records it
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
    launch, launch_freqs, B, H, D, BLOCK_H, BLOCK_D, warps, rounded, empty, _ = _plan(x, backward)
    if empty:
        return y
    s = ta.stride()  # one tuple indexed twice: stride(dim) parses its overloads (int or name) on every call
    if mode == 0:
        launch_freqs(x, y, ta, B, H, D, rot, *x.stride(), *y.stride(), s[dims[0]], s[dims[1]],
                     backward, rounded, BLOCK_H, BLOCK_D, num_warps=warps)
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
           # The constexprs positionally (MODE, BACKWARD, ROUND, BLOCK_H, BLOCK_D, BLOCK_CU): each
           # keyword costs a launch ~2,000 instructions of dictionary building and binding.
           mode, backward, rounded, BLOCK_H, BLOCK_D, block_cu, num_warps=warps)
    return y
