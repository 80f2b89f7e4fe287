"""``out[i] = a[idx[i]] * b[i]`` (a gather-multiply over rows) and its transpose, the segment sum
``out[r] = Σ_{i: idx[i] = r} g[i] * b[i]``.

The segment sum is deterministic by construction: the caller sorts ``idx`` (stable) and passes the sorted
values and the permutation; each program finds its target rows' segment bounds by binary search in the
sorted values (no counting, scan or bounds buffer around the launch), owns one block of target rows and one
block of features and adds its contributions in sorted order. No atomics, so repeated indices give the same bits
on every run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _gather_mul(a_ptr, b_ptr, idx_ptr, out_ptr, R, M, F, sa, sb, so, ROWS: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    rmask = rows < M
    mask = rmask[:, None] & (cols < F)[None, :]
    src = tl.load(idx_ptr + rows, mask=rmask, other=0).to(tl.int64)
    # An index outside a's R rows is not read (no host check runs before the launch): its row is NaN.
    ok = ((src >= 0) & (src < R))[:, None]
    a = tl.load(a_ptr + src[:, None] * sa + cols[None, :], mask=mask & ok, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows.to(tl.int64)[:, None] * sb + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    out = tl.where(ok, a * b, float("nan"))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * so + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_gather_mul)


@triton.jit
def _lower_bound(sorted_ptr, M, target, mask, steps):
    """First position in the ascending ``sorted_ptr[0:M]`` holding a value ≥ ``target`` (per lane)."""
    lo = tl.zeros_like(target)
    hi = tl.zeros_like(target) + M
    for _ in range(steps):  # steps = bit_length(M): the interval [lo, hi) is empty after it
        active = mask & (lo < hi)
        mid = (lo + hi) // 2
        v = tl.load(sorted_ptr + mid, mask=active, other=0)
        right = v < target
        lo = tl.where(active & right, mid + 1, lo)
        hi = tl.where(active & (v >= target), mid, hi)
    return lo


@triton.jit
def _segment_mul_sum(g_ptr, b_ptr, perm_ptr, sorted_ptr, out_ptr, a_ptr, out2_ptr, R, M, F, steps, sg, sb, so,
                     sa, so2, ROWS: tl.constexpr, BLOCK_F: tl.constexpr, PAIR: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    rmask = rows < R
    fmask = (cols < F)[None, :]
    lo = _lower_bound(sorted_ptr, M, rows.to(tl.int64), rmask, steps)
    hi = _lower_bound(sorted_ptr, M, rows.to(tl.int64) + 1, rmask, steps)
    acc = tl.zeros((ROWS, BLOCK_F), tl.float32)
    if PAIR:  # the rows i of this segment gather exactly this target row: out2[i] = g[i] * a[r] comes free
        a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * sa + cols[None, :], mask=rmask[:, None] & fmask,
                    other=0.0).to(tl.float32)
    # As many steps as this program's longest segment: a runtime bound, no host sync.
    for j in range(0, tl.max(hi - lo, axis=0)):
        live = (lo + j) < hi
        i = tl.load(perm_ptr + lo + j, mask=rmask & live, other=0).to(tl.int64)
        m = (rmask & live)[:, None] & fmask
        g = tl.load(g_ptr + i[:, None] * sg + cols[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + i[:, None] * sb + cols[None, :], mask=m, other=0.0).to(tl.float32)
        acc += g * b
        if PAIR:
            tl.store(out2_ptr + i[:, None] * so2 + cols[None, :], (g * a).to(out2_ptr.dtype.element_ty), mask=m)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * so + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None] & fmask)
    if PAIR:
        # Indices outside [0, R) (sorted before the first segment and after the last) belong to no target row:
        # the first and last programs write their out2 rows as zeros, so that every row of out2 is defined.
        zero = tl.zeros((ROWS, BLOCK_F), tl.float32).to(out2_ptr.dtype.element_ty)
        if tl.program_id(0) == 0:
            first = tl.min(tl.where(rmask, lo, M), axis=0)  # lower bound of 0
            for s in range(0, first, ROWS):
                _zero_rows(perm_ptr, out2_ptr, s, first, cols, fmask, so2, zero, ROWS)
        if tl.program_id(0) == tl.num_programs(0) - 1:
            last = tl.max(tl.where(rmask, hi, 0), axis=0)  # lower bound of R
            for s in range(last, M, ROWS):
                _zero_rows(perm_ptr, out2_ptr, s, M, cols, fmask, so2, zero, ROWS)


@triton.jit
def _zero_rows(perm_ptr, out_ptr, start, end, cols, fmask, so, zero, ROWS: tl.constexpr):
    """Zeros into the rows ``perm[start:end]`` (at most ROWS of them) of ``out``."""
    pos = start + tl.arange(0, ROWS)
    pm = pos < end
    i = tl.load(perm_ptr + pos, mask=pm, other=0).to(tl.int64)
    tl.store(out_ptr + i[:, None] * so + cols[None, :], zero, mask=pm[:, None] & fmask)


def _tiles(m: int, f: int):
    block_f = min(next_power_of_2(max(f, 1)), 256)
    budget = 16384 if _INTERP else 2048
    rows = max(1, min(next_power_of_2(max(m, 1)), budget // block_f))
    return rows, block_f


_PLANS = _tuning.plan_cache()  # (rows, features, which launcher) -> (launch, ROWS, BLOCK_F)


def plan(m: int, f: int, segment: bool) -> tuple:
    """``(launch, ROWS, BLOCK_F)`` of the gather-multiply over ``m`` rows (``segment`` False) or of the segment
    sum into ``m`` rows (True) of ``f`` features: the kernel bound to its grid (``kernel[grid]`` builds that
    closure at every call otherwise) and its tiles."""
    key = (m, f, segment)
    p = _PLANS.get(key)
    if p is None:
        rows, bf = _tiles(m, f)
        if segment and _INTERP:
            rows = min(rows, 16)
        p = _PLANS[key] = ((_segment_mul_sum if segment else _gather_mul)[(cdiv(m, rows), cdiv(f, bf))], rows, bf)
    return p


# The launches' argument lists, written once: this module's launchers and apex.ops._index_mul_direct (which keeps
# the plans of a layout) both launch through them. The constexprs go positionally: a keyword costs a launch a
# dictionary entry to build and bind (~2,000 instructions).
def launch_gather(p: tuple, a, b, idx, out, R: int, m: int, f: int, sa: int, sb: int) -> None:
    """``out = a[idx] * b`` (``out`` contiguous ``[m, f]``) with the plan ``p`` of ``(m, f, False)``; ``sa``,
    ``sb`` the row strides of ``a`` (``R`` rows) and ``b`` (unit feature strides)."""
    p[0](a, b, idx, out, R, m, f, sa, sb, f, p[1], p[2])  # ROWS, BLOCK_F


def launch_segment(p: tuple, g, b, perm, ordered, out, a, out2, R: int, m: int, f: int, sg: int, sb: int,
                   sa: int) -> None:
    """The segment sum into ``out`` (contiguous ``[R, f]``) with the plan ``p`` of ``(R, f, True)``; with ``a``
    (row stride ``sa``) also ``out2 = a[idx] * g`` (contiguous ``[m, f]``), else ``a`` and ``out2`` None."""
    pair = a is not None
    p[0](g, b, perm, ordered, out, a if pair else out, out2 if pair else out, R, m, f, m.bit_length(), sg, sb, f,
         sa if pair else 0, f if pair else 0, p[1], p[2], pair)  # ROWS, BLOCK_F, PAIR


def gather_mul(a: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a[idx] * b`` for 2-D ``a``, ``b`` with unit feature stride; ``idx`` int64 (a row of ``out`` whose index
    is outside ``a``'s rows is NaN)."""
    m, f = b.shape
    # new_empty with integer sizes: ~1 µs less than torch.empty((m, f), device=..., dtype=...).
    out = b.new_empty(m, f) if out_dtype == b.dtype else b.new_empty(m, f, dtype=out_dtype)
    if m and f:
        launch_gather(plan(m, f, False), a, b, idx, out, a.shape[0], m, f, a.stride(0), b.stride(0))
    return out


def segment_mul_sum(g: torch.Tensor, b: torch.Tensor, idx: torch.Tensor, rows_out: int,
                    out_dtype: torch.dtype, a: torch.Tensor | None = None, order=None):
    """``out[r] = Σ_{i: idx[i] = r} g[i] * b[i]`` (fp32 accumulation, sorted order). With ``a`` (the gathered
    tensor), also ``out2 = a[idx] * g`` from the same pass, returned as ``(out, out2)``. ``order``: the
    caller's ``torch.sort(idx, stable=True)`` (sorted values, permutation), if it has one. An index outside
    ``[0, rows_out)`` adds to no row of ``out``, and its row of ``out2`` is zero."""
    m, f = b.shape
    same = out_dtype == b.dtype
    out = b.new_empty(rows_out, f) if same else b.new_empty(rows_out, f, dtype=out_dtype)
    pair = a is not None
    out2 = (b.new_empty(m, f) if same else b.new_empty(m, f, dtype=out_dtype)) if pair else None
    if rows_out == 0 or f == 0:
        if pair:
            out2.zero_()  # every index is out of range (or no features)
        return (out, out2) if pair else out
    ordered, perm = order if order else torch.sort(idx, stable=True)
    # out and out2 are contiguous: their row stride is f.
    launch_segment(plan(rows_out, f, True), g, b, perm, ordered, out, a, out2, rows_out, m, f, g.stride(0),
                   b.stride(0), a.stride(0) if pair else 0)
    return (out, out2) if pair else out
