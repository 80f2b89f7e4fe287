"""Triton kernels of the RNN-T joint ``h[b, t, u] = f[b, t] + g[b, u]`` (optionally ReLU and dropout).

Forward: one program per (batch, t, tile of ``TILE_U`` values of u, block of H): the f row is loaded once
and reused for the tile (Apex's ``fwd_tile_size``); each output row goes to its dense or packed position.
Backward: one program per (batch, t or u, block of H) sums the incoming gradient over the other axis in
fp32, so ``f``'s and ``g``'s gradients are written once each without atomics (deterministic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, next_power_of_2


@triton.jit
def _row_of(b, t, u, T, U, g_len, offset, PACKED: tl.constexpr):
    # The output row of cell (b, t, u): dense (B, T, U) layout, or packed (cells with t < f_len[b] and
    # u < g_len[b], row-major per batch element starting at batch_offset[b - 1]).
    if PACKED:
        return offset + t * g_len + u
    return (b * T + t).to(tl.int64) * U + u


@triton.jit
def _joint_fwd(f_ptr, g_ptr, flen_ptr, glen_ptr, boff_ptr, h_ptr, mask_ptr, T, U, H, p_keep, seed,
               PACKED: tl.constexpr, RELU: tl.constexpr, DROPOUT: tl.constexpr, TILE_U: tl.constexpr,
               BLOCK_H: tl.constexpr):
    bt = tl.program_id(0).to(tl.int64)  # int64 index arithmetic (and no interpreter overflow checks)
    b = bt // T
    t = bt % T
    u0 = tl.program_id(1).to(tl.int64) * TILE_U
    hs = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    f_len = tl.load(flen_ptr + b).to(tl.int64)
    g_len = tl.load(glen_ptr + b).to(tl.int64)
    offset = 0
    if PACKED:
        offset = tl.load(boff_ptr + b - 1, mask=b > 0, other=0)
    # The range check, here rather than on the host (a host read is a GPU synchronisation per call): an entry
    # whose lengths are out of range reads nothing and gets NaN everywhere (and a zero mask and gradient).
    bad = (f_len < 0) | (f_len > T) | (g_len < 0) | (g_len > U)
    t_ok = (t < f_len) & ~bad
    fv = tl.load(f_ptr + (b * T + t).to(tl.int64) * H + hs, mask=tl.where(t_ok, hm, False), other=0.0)
    scale = 1.0 / p_keep if DROPOUT else 1.0
    for j in tl.static_range(TILE_U):
        u = u0 + j
        valid = t_ok & (u < g_len)
        gv = tl.load(g_ptr + (b * U + u).to(tl.int64) * H + hs, mask=tl.where(valid, hm, False), other=0.0)
        # fp32 sum rounded once to the output dtype (bf16 arithmetic is not native everywhere)
        out = fv.to(tl.float32) + gv.to(tl.float32)
        row = _row_of(b, t, u, T, U, g_len, offset, PACKED)
        if RELU or DROPOUT:
            keep = hm
            if RELU:
                keep = keep & (out > 0)
            if DROPOUT:
                r = tl.rand(seed, row * H + hs)
                keep = keep & (r < p_keep)
            out = tl.where(keep, out * scale, 0.0)
            tl.store(mask_ptr + row * H + hs, keep.to(tl.uint8), mask=tl.where(valid, hm, False))
        if PACKED:
            tl.store(h_ptr + row * H + hs, out.to(h_ptr.dtype.element_ty), mask=tl.where(valid, hm, False))
        else:
            # The dense layout's don't-care region gets -1 (finite, as Apex writes it).
            out = tl.where(valid, out, tl.where(bad, float("nan"), -1.0))
            tl.store(h_ptr + row * H + hs, out.to(h_ptr.dtype.element_ty), mask=tl.where(u < U, hm, False))


@triton.jit
def _joint_bwd(dh_ptr, mask_ptr, flen_ptr, glen_ptr, boff_ptr, df_ptr, dg_ptr, T, U, H, scale,
               PACKED: tl.constexpr, MASKED: tl.constexpr, FOR_F: tl.constexpr, BLOCK_H: tl.constexpr):
    # FOR_F: program (b, t) sums over u into df[b, t]; otherwise program (b, u) sums over t into dg[b, u].
    pid = tl.program_id(0).to(tl.int64)
    L = T if FOR_F else U
    b = pid // L
    i = pid % L
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    f_len = tl.load(flen_ptr + b).to(tl.int64)
    g_len = tl.load(glen_ptr + b).to(tl.int64)
    offset = 0
    if PACKED:
        offset = tl.load(boff_ptr + b - 1, mask=b > 0, other=0)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if FOR_F:
        n = tl.where(i < f_len, g_len, 0)
    else:
        n = tl.where(i < g_len, f_len, 0)
    n = tl.where((f_len < 0) | (f_len > T) | (g_len < 0) | (g_len > U), 0, n)  # out of range: zero gradient
    for k in range(0, n):
        if FOR_F:
            row = _row_of(b, i, k, T, U, g_len, offset, PACKED)
        else:
            row = _row_of(b, k, i, T, U, g_len, offset, PACKED)
        d = tl.load(dh_ptr + row * H + hs, mask=hm, other=0.0).to(tl.float32)
        if MASKED:
            m = tl.load(mask_ptr + row * H + hs, mask=hm, other=0)
            d = tl.where(m != 0, d * scale, 0.0)
        acc += d
    if FOR_F:
        tl.store(df_ptr + (b * T + i).to(tl.int64) * H + hs, acc.to(df_ptr.dtype.element_ty), mask=hm)
    else:
        tl.store(dg_ptr + (b * U + i).to(tl.int64) * H + hs, acc.to(dg_ptr.dtype.element_ty), mask=hm)


def _block_h(H: int) -> int:
    return min(1024, next_power_of_2(max(H, 16)))


# The forward's grid and feature block by (B, T, U, H, tile): a call of a shape seen before looks them up.
_PLANS = _tuning.plan_cache()


def forward(f, g, f_len, g_len, batch_offset, packed_batch: int, pack_output: bool, relu: bool,
            dropout: bool, dropout_prob: float, tile_size: int, seed: int):
    """``(h, mask or None)``; ``f`` (B, T, H) and ``g`` (B, U, H) contiguous, lengths int32."""
    B, T, H = f.shape
    U = g.shape[1]
    masked = relu or dropout
    shape = (packed_batch, H) if pack_output else (B, T, U, H)
    h = torch.empty(*shape, dtype=f.dtype, device=f.device)  # (integer sizes: a tuple costs ~1 µs more)
    mask = torch.zeros(shape, dtype=torch.uint8, device=f.device) if masked else h
    boff = batch_offset if pack_output else f_len
    plan = _PLANS.get((B, T, U, H, tile_size))
    if plan is None:
        bh = _block_h(H)
        plan = _PLANS[(B, T, U, H, tile_size)] = ((B * T, cdiv(U, tile_size), cdiv(H, bh)), bh)
    grid, bh = plan
    # The constexprs positionally (PACKED, RELU, DROPOUT, TILE_U, BLOCK_H): each keyword costs a launch
    # ~2,000 instructions of dictionary building and binding.
    _joint_fwd[grid](f, g, f_len, g_len, boff, h, mask, T, U, H, 1.0 - dropout_prob, seed,
                     pack_output, relu, dropout, tile_size, bh)
    return h, (mask if masked else None)


def forward_dense(f, g, f_len, g_len, B: int, T: int, U: int, H: int, relu: bool, dropout: bool,
                  dropout_prob: float, tile_size: int, seed: int):
    """:func:`forward` of a dense output, the sizes read once by the caller and passed as integers."""
    masked = relu or dropout
    h = f.new_empty(B, T, U, H)  # (f's own dtype and device: no parsing of either)
    mask = f.new_zeros(B, T, U, H, dtype=torch.uint8) if masked else h
    plan = _PLANS.get((B, T, U, H, tile_size))
    if plan is None:
        bh = _block_h(H)
        plan = _PLANS[(B, T, U, H, tile_size)] = ((B * T, cdiv(U, tile_size), cdiv(H, bh)), bh)
    grid, bh = plan
    _joint_fwd[grid](f, g, f_len, g_len, f_len, h, mask, T, U, H, 1.0 - dropout_prob, seed,
                     False, relu, dropout, tile_size, bh)  # PACKED, RELU, DROPOUT, TILE_U, BLOCK_H
    return h, (mask if masked else None)


_BWD_PLANS = _tuning.plan_cache()


def backward_dense(dh, mask, f_len, g_len, B: int, T: int, U: int, H: int, scale: float):
    """:func:`backward` of a dense output (``dh`` contiguous), the sizes passed as integers."""
    df, dg = dh.new_empty(B, T, H), dh.new_empty(B, U, H)  # (dh has the inputs' dtype and device)
    plan = _BWD_PLANS.get((B, T, U, H))
    if plan is None:
        bh = _block_h(H)
        plan = _BWD_PLANS[(B, T, U, H)] = ((B * T, cdiv(H, bh)), (B * U, cdiv(H, bh)), bh)
    grid_f, grid_g, bh = plan
    masked = mask is not None
    m = mask if masked else dh
    # PACKED, MASKED, FOR_F, BLOCK_H
    _joint_bwd[grid_f](dh, m, f_len, g_len, f_len, df, dg, T, U, H, scale, False, masked, True, bh)
    _joint_bwd[grid_g](dh, m, f_len, g_len, f_len, df, dg, T, U, H, scale, False, masked, False, bh)
    return df, dg


def backward(dh, mask, f_len, g_len, batch_offset, T: int, U: int, pack_output: bool, scale: float):
    """``(df, dg)`` of shapes (B, T, H) and (B, U, H), zero outside the lengths."""
    B = f_len.shape[0]
    H = dh.shape[-1]
    df = torch.empty(B, T, H, dtype=dh.dtype, device=dh.device)
    dg = torch.empty(B, U, H, dtype=dh.dtype, device=dh.device)
    boff = batch_offset if pack_output else f_len
    m = mask if mask is not None else dh
    bh = _block_h(H)
    for for_f, L in ((True, T), (False, U)):
        _joint_bwd[(B * L, cdiv(H, bh))](dh, m, f_len, g_len, boff, df, dg, T, U, H, scale,
                                         pack_output, mask is not None, for_f, bh)  # PACKED, MASKED, FOR_F, BLOCK_H
    return df, dg
