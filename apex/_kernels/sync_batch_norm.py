"""Triton kernels of SyncBatchNorm on a contiguous ``[N, C, L]`` input (channel-last is ``L = 1``).

Element ``(n, c, l)`` lives at ``n*C*L + c*L + l``; ``r = n*L + l`` runs over the ``R = N*L`` values of a
channel. A program owns ``BLOCK_C`` channels and ``ITERS`` tiles of ``BLOCK_R`` values of ``r``, so both
layouts read memory in contiguous runs (along ``l`` channel-first, along ``c`` channel-last). Reductions
write one fp32 partial per (program row, channel); the launcher sums the few partial rows, so results are
deterministic (no atomics). Each kernel reads its inputs once and writes its outputs once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels._host import cdiv, interpreted, next_power_of_2


def _layout(x: torch.Tensor) -> tuple[int, int, int, int, int, int, int]:
    N, C, L = x.shape
    R = N * L
    bc = min(next_power_of_2(C), 32 if L == 1 else 4)
    if _INTERP:
        # The interpreter pays per op, not per element: few large tiles.
        br = max(16, min(next_power_of_2(R), 4096 // bc))
        max_rows = 4
    else:
        br = max(16, min(next_power_of_2(R), 2048 // bc))
        max_rows = 256
    tiles = cdiv(R, br)
    rows = min(tiles, max_rows)
    iters = cdiv(tiles, rows)
    rows = cdiv(tiles, iters)
    return C, L, R, bc, br, rows, iters


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
def _stats_kernel(x_ptr, s1_ptr, s2_ptr, shift_ptr, C, L, R, ITERS,
                  BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
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
    tl.store(s1_ptr + pr * C + c, tl.sum(acc1, axis=0), mask=cmask)
    tl.store(s2_ptr + pr * C + c, tl.sum(acc2, axis=0), mask=cmask)
    tl.store(shift_ptr + c, shift, mask=cmask & ((c * 0 + pr) == 0))


@triton.jit
def _forward_kernel(x_ptr, z_ptr, y_ptr, scale_ptr, shift_ptr, C, L, R, ITERS,
                    HAS_Z: tl.constexpr, RELU: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
    scale = tl.load(scale_ptr + c, mask=cmask, other=0.0)
    shift = tl.load(shift_ptr + c, mask=cmask, other=0.0)
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
def _backward_reduce_kernel(dy_ptr, x_ptr, z_ptr, mean_ptr, scale_ptr, shift_ptr, s1_ptr, s2_ptr,
                            C, L, R, ITERS, HAS_Z: tl.constexpr, RELU: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
    mean = tl.load(mean_ptr + c, mask=cmask, other=0.0)
    scale = tl.load(scale_ptr + c, mask=cmask, other=0.0)
    shift = tl.load(shift_ptr + c, mask=cmask, other=0.0)
    acc1 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
    for it in range(ITERS):
        off, mask = _tile(pc, pr, it, C, L, R, ITERS, BLOCK_R, BLOCK_C)
        x, d = _grad_act(dy_ptr, x_ptr, z_ptr, off, mask, scale, shift, HAS_Z, RELU)
        acc1 += d
        acc2 += tl.where(mask, d * (x - mean[None, :]), 0.0)
    tl.store(s1_ptr + pr * C + c, tl.sum(acc1, axis=0), mask=cmask)
    tl.store(s2_ptr + pr * C + c, tl.sum(acc2, axis=0), mask=cmask)


@triton.jit
def _backward_elemt_kernel(dy_ptr, x_ptr, z_ptr, dx_ptr, dz_ptr, mean_ptr, scale_ptr, shift_ptr, mdy_ptr,
                           k_ptr, C, L, R, ITERS, HAS_Z: tl.constexpr, RELU: tl.constexpr,
                           NEED_DZ: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    pc, pr, c, cmask = _channel_block(C, BLOCK_C)
    mean = tl.load(mean_ptr + c, mask=cmask, other=0.0)
    scale = tl.load(scale_ptr + c, mask=cmask, other=0.0)
    shift = tl.load(shift_ptr + c, mask=cmask, other=0.0)
    mdy = tl.load(mdy_ptr + c, mask=cmask, other=0.0)
    k = tl.load(k_ptr + c, mask=cmask, other=0.0)
    for it in range(ITERS):
        off, mask = _tile(pc, pr, it, C, L, R, ITERS, BLOCK_R, BLOCK_C)
        x, d = _grad_act(dy_ptr, x_ptr, z_ptr, off, mask, scale, shift, HAS_Z, RELU)
        dx = (d - mdy[None, :] - (x - mean[None, :]) * k[None, :]) * scale[None, :]
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DZ:
            tl.store(dz_ptr + off, d.to(dz_ptr.dtype.element_ty), mask=mask)


def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    C, L, R, bc, br, rows, iters = _layout(x)
    s1 = torch.empty((rows, C), dtype=torch.float32, device=x.device)
    s2 = torch.empty_like(s1)
    shift = torch.empty(C, dtype=torch.float32, device=x.device)
    _stats_kernel[(cdiv(C, bc), rows)](x, s1, s2, shift, C, L, R, iters, BLOCK_R=br, BLOCK_C=bc)
    m1 = s1.sum(0) / R
    var = (s2.sum(0) / R - m1 * m1).clamp_(min=0)
    return shift + m1, var


def forward(x, scale, shift, z, fuse_relu: bool) -> torch.Tensor:
    C, L, R, bc, br, rows, iters = _layout(x)
    y = torch.empty_like(x)
    _forward_kernel[(cdiv(C, bc), rows)](x, z if z is not None else x, y, scale.contiguous(),
                                                 shift.contiguous(), C, L, R, iters, HAS_Z=z is not None,
                                                 RELU=bool(fuse_relu), BLOCK_R=br, BLOCK_C=bc)
    return y


def backward_reduce(dy, x, mean, scale, shift, z, fuse_relu: bool):
    C, L, R, bc, br, rows, iters = _layout(x)
    s1 = torch.empty((rows, C), dtype=torch.float32, device=x.device)
    s2 = torch.empty_like(s1)
    _backward_reduce_kernel[(cdiv(C, bc), rows)](
        dy, x, z if z is not None else x, mean.contiguous(), scale.contiguous(), shift.contiguous(), s1, s2,
        C, L, R, iters, HAS_Z=z is not None, RELU=bool(fuse_relu), BLOCK_R=br, BLOCK_C=bc)
    return s1.sum(0), s2.sum(0)


def backward_elemt(dy, x, mean, invstd, scale, shift, mean_dy, mean_dy_xmu, z, fuse_relu: bool,
                   need_dz: bool):
    C, L, R, bc, br, rows, iters = _layout(x)
    dx = torch.empty_like(x)
    dz = torch.empty_like(x) if need_dz else dx
    k = (mean_dy_xmu * invstd * invstd).contiguous()
    _backward_elemt_kernel[(cdiv(C, bc), rows)](
        dy, x, z if z is not None else x, dx, dz, mean.contiguous(), scale.contiguous(), shift.contiguous(),
        mean_dy.contiguous(), k, C, L, R, iters, HAS_Z=z is not None, RELU=bool(fuse_relu),
        NEED_DZ=bool(need_dz), BLOCK_R=br, BLOCK_C=bc)
    return dx, (dz if need_dz else None)
