"""L2 (and max) norms over lists of tensors: per-chunk partials, then one deterministic finalize launch.

Pass 1 (one launch per dtype group) writes each chunk's sum of squares (or max |x|) in fp32 into a
partials buffer and flags a non-finite partial. Pass 2 (one launch, one program) reduces the partials of
each tensor and of the whole list in a fixed order, so results are bitwise reproducible and independent of
Apex's ``chunk_size`` argument.
"""

from __future__ import annotations

from operator import is_

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt
from apex._kernels._host import next_power_of_2


@triton.jit
def _partials_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, partials, partial_offset, noop_flag,
                     inv_scale_ptr, out_scale,
                     IN_DT: tl.constexpr, OUT_DT: tl.constexpr, HAS_INV_SCALE: tl.constexpr,
                     WRITE_OUT: tl.constexpr, MAX_NORM: tl.constexpr, SKIP_IF_FLAGGED: tl.constexpr,
                     ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED)
    x_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, IN_DT, ALIGNED)
    o_ptr = x_ptr
    if WRITE_OUT:
        o_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, OUT_DT, ALIGNED)
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
def _finalize_kernel(partials, n_partials, bounds, last_at, n_tensors, total_out, per_tensor_out,
                     per_tensor_prev, alpha, beta,
                     PER_TENSOR: tl.constexpr, MAX_NORM: tl.constexpr, BLEND: tl.constexpr,
                     BLOCK: tl.constexpr):
    tl.store(total_out, _reduce_partials(partials, 0, n_partials, MAX_NORM, BLOCK))
    if PER_TENSOR:
        # Tensor t's partials are [bounds[t], bounds[last_at + t]).
        for t in range(0, n_tensors):
            lo = tl.load(bounds + t)
            hi = tl.load(bounds + last_at + t)
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
    lists = [inputs] if outputs is None else [inputs, outputs]
    groups = mt.group(lists)
    tables = [mt.table(sub) for _, sub in groups]
    device = tables[0].ptrs.device if tables else inputs[0].device
    n_partials = sum(tab.n_chunks for tab in tables)
    partials = torch.empty(max(n_partials, 1), dtype=torch.float32, device=device)
    offset = 0
    dummy = partials
    for tab in tables:
        in_dt = tab.dtypes[0]
        out_dt = tab.dtypes[1] if outputs is not None else in_dt
        mt.launch_with_dtypes(
            _partials_kernel, tab, (in_dt, out_dt), partials, offset, noop_flag,
            inv_scale if inv_scale is not None else dummy, float(out_scale),
            options=(inv_scale is not None, outputs is not None, max_norm, skip_if_flagged, tab.aligned))
        offset += tab.n_chunks
    n = len(inputs)
    want_per_tensor = per_tensor or blend_into is not None
    bounds, last_at = _bounds(groups, tables, n, device) if want_per_tensor else (partials, 0)
    total = torch.empty(1, dtype=torch.float32, device=device)
    per = blend_into if blend_into is not None else torch.empty(
        n if per_tensor else 0, dtype=torch.float32, device=device)
    _finalize_kernel[(1,)](
        partials, n_partials, bounds, last_at, n, total,
        per if want_per_tensor else total, per if blend_into is not None else total, float(alpha), float(beta),
        want_per_tensor, max_norm, blend_into is not None,  # PER_TENSOR, MAX_NORM, BLEND, BLOCK by position
        min(1024, next_power_of_2(max(n_partials, 1))))
    return total, per


@triton.jit
def _pair_partials_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, partials, n_chunks, noop_flag,
                          A_DT: tl.constexpr, B_DT: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Each chunk's sums of squares of lists 0 and 1 (at ``partials[pid]``, ``partials[n_chunks + pid]``),
    summed as :func:`_partials_kernel` sums; flags a non-finite one."""
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED)
    a_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, A_DT, ALIGNED)
    b_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, B_DT, ALIGNED)
    acc_a = tl.zeros([BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        a = tl.load(a_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        acc_a += a * a
        acc_b += b * b
    part_a = tl.sum(acc_a, axis=0)
    part_b = tl.sum(acc_b, axis=0)
    pid = tl.program_id(0)
    tl.store(partials + pid, part_a)
    tl.store(partials + n_chunks + pid, part_b)
    bad = (part_a != part_a) | (part_a == float("inf")) | (part_b != part_b) | (part_b == float("inf"))
    tl.store(noop_flag, 1, mask=bad)


def pair_norms(noop_flag: torch.Tensor, tab: mt.TensorTable, scratch: dict | None = None) -> torch.Tensor:
    """Per-tensor L2 norms of lists 0 and 1 of ``tab`` (an optimizer's table, e.g. LARS's gradients and
    parameters) in two launches: ``out[:T]`` of list 0, ``out[T:2T]`` of list 1 (fp32). A non-finite norm
    sets ``noop_flag``. ``scratch``: a dict kept from call to call for the partial sums and the result (which
    the next call overwrites: stream-ordered, after this step's launches)."""
    from apex._kernels._chunk_reduce import reduce_rows

    device = tab.ptrs.device
    partials = _scratch(scratch, ("pair partials", device), 2 * tab.n_chunks, device)
    mt.launch_with_dtypes(_pair_partials_kernel, tab, tab.dtypes[:2], partials, tab.n_chunks, noop_flag,
                          options=(tab.aligned,))
    out = _scratch(scratch, ("pair norms", device), 2 * tab.n_tensors, device)
    reduce_rows(partials, tab, out, 2)
    return out


def total_of_tables(noop_flag: torch.Tensor, tables: list, *, skip_if_flagged: bool = False,
                    scratch: dict | None = None) -> torch.Tensor:
    """The L2 norm (one-element fp32 tensor) of list 0 of every table in ``tables``: an optimizer's own
    tables of ``[grads, ...]``, so that a step with new gradients builds one table, not one more for the
    norm. Partials lie table after table, as :func:`norms` lays out its groups. ``scratch``: a dict the
    caller keeps from call to call, which holds the partials and the result (stream-ordered reuse: the next
    call's launches come after this call's)."""
    device = tables[0].ptrs.device
    n_partials = sum(tab.n_chunks for tab in tables)
    partials = _scratch(scratch, ("norm partials", device), max(n_partials, 1), device)
    total = _scratch(scratch, ("norm total", device), 1, device)
    offset = 0
    for tab in tables:
        in_dt = tab.dtypes[0]
        mt.launch_with_dtypes(_partials_kernel, tab, (in_dt, in_dt), partials, offset, noop_flag, partials, 1.0,
                              options=(False, False, False, skip_if_flagged, tab.aligned))
        offset += tab.n_chunks
    _finalize_kernel[(1,)](partials, n_partials, partials, 0, 0, total, total, total, 1.0, 1.0,
                           False, False, False, min(1024, next_power_of_2(max(n_partials, 1))))
    return total


def _scratch(scratch: dict | None, key, n: int, device: torch.device) -> torch.Tensor:
    """An fp32 buffer of at least ``n`` elements: kept in ``scratch`` under ``key`` (None: a new one)."""
    if scratch is None:
        return torch.empty(n, dtype=torch.float32, device=device)
    buf = scratch.get(key)
    if buf is None or buf.numel() < n:
        buf = scratch[key] = torch.empty(n, dtype=torch.float32, device=device)
    return buf


_bounds_cache = mt._LRU()


def _bounds(groups: list, tables: list, n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(bounds, last_at)``: tensor ``i``'s partials are ``[bounds[i], bounds[last_at + i])``.

    One group of every tensor (an optimizer's lists, a list of one dtype): the table's own device index of
    first chunks, ``last_at = 1``. Otherwise the groups' partials lie one group after the other and the
    bounds map them back to the tensors' places (empty tensors: an empty range): built once per (tables,
    grouping) and uploaded without blocking, since both are cached objects that a repeated call gets back."""
    if len(tables) == 1 and len(groups[0][0]) == n:
        return tables[0].first, 1
    key = (n, tuple(map(id, tables)), tuple(id(idx) for idx, _ in groups))
    cached = _bounds_cache.get(key)
    if cached is not None and all(map(is_, cached[0], tables)) and all(
            a is idx for a, (idx, _) in zip(cached[1], groups)):
        return cached[2], n
    first, last = [0] * n, [0] * n
    offset = 0
    for (idx, _), tab in zip(groups, tables):
        for j, i in enumerate(idx):
            first[i] = offset + tab.chunk_first[j]
            last[i] = offset + tab.chunk_first[j + 1]
        offset += tab.n_chunks
    dev = mt._upload(first + last, device)
    _bounds_cache.put(key, (tuple(tables), tuple(idx for idx, _ in groups), dev))
    return dev, n
