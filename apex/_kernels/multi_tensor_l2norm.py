"""L2 (and max) norms over lists of tensors: per-chunk partials, then one deterministic finalize launch.

Pass 1 (one launch per dtype group) writes each chunk's sum of squares (or max |x|) in fp32 into a
partials buffer and flags a non-finite partial. Pass 2 (one launch, one program) reduces the partials of
each tensor and of the whole list in a fixed order, so results are bitwise reproducible and independent of
Apex's ``chunk_size`` argument.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt


@triton.jit
def _partials_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, partials, partial_offset, noop_flag,
                     inv_scale_ptr, out_scale,
                     IN_DT: tl.constexpr, OUT_DT: tl.constexpr, HAS_INV_SCALE: tl.constexpr,
                     WRITE_OUT: tl.constexpr, MAX_NORM: tl.constexpr, SKIP_IF_FLAGGED: tl.constexpr,
                     CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start)
    x_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, IN_DT)
    o_ptr = x_ptr
    if WRITE_OUT:
        o_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, OUT_DT)
    if SKIP_IF_FLAGGED:
        # A flagged step is skipped whole: nothing is read, every partial is 0.
        n = tl.where(tl.load(noop_flag) != 0, 0, n)
    inv_scale = 1.0
    if HAS_INV_SCALE:
        inv_scale = tl.load(inv_scale_ptr)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_INV_SCALE:
            x = x * inv_scale
        if WRITE_OUT:
            tl.store(o_ptr + idx, (x * out_scale).to(OUT_DT), mask=mask)
        if MAX_NORM:
            acc = tl.maximum(acc, tl.abs(x))
        else:
            acc += x * x
    if MAX_NORM:
        part = tl.max(acc, axis=0)
    else:
        part = tl.sum(acc, axis=0)
    pid = tl.program_id(0)
    tl.store(partials + partial_offset + pid, part)
    bad = (part != part) | (part == float("inf"))
    tl.store(noop_flag, 1, mask=bad)


@triton.jit
def _reduce_partials(partials, lo, hi, MAX_NORM: tl.constexpr, BLOCK: tl.constexpr):
    """The norm from the partials ``[lo, hi)``: their max (max norm) or the root of their sum (L2)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(lo, hi, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        p = tl.load(partials + idx, mask=idx < hi, other=0.0)
        if MAX_NORM:
            acc = tl.maximum(acc, p)
        else:
            acc += p
    if MAX_NORM:
        norm = tl.max(acc, axis=0)
    else:
        norm = tl.sqrt_rn(tl.sum(acc, axis=0))  # IEEE: tl.sqrt is sqrt.approx on NVIDIA GPUs
    return norm


@triton.jit
def _finalize_kernel(partials, n_partials, tensor_first, tensor_last, n_tensors, total_out, per_tensor_out,
                     per_tensor_prev, alpha, beta,
                     PER_TENSOR: tl.constexpr, MAX_NORM: tl.constexpr, BLEND: tl.constexpr,
                     BLOCK: tl.constexpr):
    tl.store(total_out, _reduce_partials(partials, 0, n_partials, MAX_NORM, BLOCK))
    if PER_TENSOR:
        for t in range(0, n_tensors):
            lo = tl.load(tensor_first + t)
            hi = tl.load(tensor_last + t)
            norm = _reduce_partials(partials, lo, hi, MAX_NORM, BLOCK)
            if BLEND:
                # Apex's norm_out blend: L2 sqrt(a*old^2 + b*n^2), max a*old + b*n.
                old = tl.load(per_tensor_prev + t)
                if MAX_NORM:
                    norm = alpha * old + beta * norm
                else:
                    norm = tl.sqrt_rn(alpha * old * old + beta * norm * norm)
            tl.store(per_tensor_out + t, norm)


def norms(noop_flag: torch.Tensor, inputs: list, *, per_tensor: bool, outputs: list | None = None,
          out_scale: float = 1.0, inv_scale: torch.Tensor | None = None, max_norm: bool = False,
          skip_if_flagged: bool = False, blend_into: torch.Tensor | None = None, alpha: float = 1.0,
          beta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Total and per-tensor norms of ``inputs`` (optionally times ``inv_scale``), fp32 on their device.

    With ``outputs`` also writes ``outputs[i] = inputs[i] * out_scale``. With ``blend_into`` the
    per-tensor norms are blended into that tensor in place (Apex's ``norm_out``).
    """
    device = inputs[0].device
    lists = [inputs] if outputs is None else [inputs, outputs]
    groups = mt.group(lists)
    tables = [mt.table(sub) for _, sub in groups]
    n_partials = sum(tab.n_chunks for tab in tables)
    partials = torch.empty(max(n_partials, 1), dtype=torch.float32, device=device)
    first = [0] * len(inputs)
    last = [0] * len(inputs)
    offset = 0
    dummy = partials
    for (idx, _), tab in zip(groups, tables):
        for j, i in enumerate(idx):
            first[i] = offset + tab.chunk_first[j]
            last[i] = offset + tab.chunk_first[j + 1]
        in_dt = tab.dtypes[0]
        out_dt = tab.dtypes[1] if outputs is not None else in_dt
        mt.launch_with_dtypes(
            _partials_kernel, tab, (in_dt, out_dt), partials, offset, noop_flag,
            inv_scale if inv_scale is not None else dummy, float(out_scale),
            HAS_INV_SCALE=inv_scale is not None, WRITE_OUT=outputs is not None, MAX_NORM=max_norm,
            SKIP_IF_FLAGGED=skip_if_flagged)
        offset += tab.n_chunks
    bounds = torch.tensor(first + last, dtype=torch.int64).to(device)
    total = torch.empty(1, dtype=torch.float32, device=device)
    want_per_tensor = per_tensor or blend_into is not None
    per = blend_into if blend_into is not None else torch.empty(
        len(inputs) if per_tensor else 0, dtype=torch.float32, device=device)
    _finalize_kernel[(1,)](
        partials, n_partials, bounds[:len(inputs)], bounds[len(inputs):], len(inputs), total,
        per if want_per_tensor else total, per if blend_into is not None else total, float(alpha), float(beta),
        PER_TENSOR=want_per_tensor, MAX_NORM=max_norm, BLEND=blend_into is not None,
        BLOCK=min(1024, triton.next_power_of_2(max(n_partials, 1))))
    return total, per
