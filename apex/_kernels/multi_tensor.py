"""The multi-tensor engine: one Triton launch over a whole list of tensors of different sizes.

A :class:`TensorTable` describes ``L`` lists of ``T`` tensors each (list ``l`` holds tensors of one dtype,
all on one device) as device-side int64 tables:

* ``ptrs[l * T + t]``: the address of tensor ``t`` of list ``l``;
* ``sizes[t]``: its number of elements (equal across lists);
* ``chunk_tensor[c]`` / ``chunk_start[c]``: which tensor program ``c`` works on and where its chunk starts;
* ``first[t]``: the index of tensor ``t``'s first chunk (``first[T]`` = the number of chunks), for kernels that
  reduce per-chunk results per tensor.

A kernel written for the engine starts with :func:`chunk_coords` and :func:`tensor_ptr`, and is launched
by :func:`launch` on a grid of one program per chunk (an element-wise kernel: ``PARTS`` per chunk, see
:func:`parts`). Chunks are ``CHUNK`` elements, a power of two fixed
by the engine (never by Apex's ``chunk_size`` argument), so results do not depend on ``chunk_size``.
Launchers take tensor lists that :func:`group` has split by (device, dtype per list): a call costs one
launch per group, whatever the number of tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._lists import column, columns

# The tables live in their own module; their names are the engine's (launchers and tests reach them here).
from apex._kernels._mt_tables import (  # noqa: F401
    _LRU,
    GPU_BLOCK,
    MAX_CHUNK,
    TORCH_TO_TL,
    TensorTable,
    _aligned16,
    _interpreting,
    _next_pow2,
    _sizes_facts,
    _upload,
    table,
    with_first_list,
)

_groupings = _LRU()
_indices = _LRU()
_ranges: dict = {}

def _all_indices(n: int) -> list[int]:
    r = _ranges.get(n)
    if r is None or len(r) != n:  # (a caller may have changed the list it was given)
        if len(_ranges) > 64:
            _ranges.clear()
        r = _ranges[n] = list(range(n))
    return r


def group(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> list[tuple[list[int], list]]:
    """Split lists into groups of tensors sharing (device, dtype of each list).

    Returns ``[(indices, sublists), ...]`` where ``indices`` are positions in the original lists (cached
    lists: read them, do not change them) and the sublists are :class:`apex._kernels._lists.Column` s.
    Empty tensors are left out: they need no work. Lists that are Columns of one device and one dtype each
    (what apex's optimizers pass) make one group without looking at any tensor; mixed lists are split by a
    plan cached on their devices, dtypes (and sizes, where one is empty), so that a repeated call picks its
    groups' tensors with C-level ``itemgetter`` s instead of a Python loop over the tensors.
    """
    cols = columns(tensor_lists)
    first = cols[0]
    if not first:
        return []
    if first.device is not None and all(c.dtype is not None for c in cols) and _sizes_facts(first.numels)[1]:
        return [(_all_indices(len(first)), cols)]
    out = []
    for idx, pick, device, dtypes in _grouping(cols):
        numels = pick(first.numels)
        out.append((idx, [column(pick(c), ptrs=pick(c.ptrs), numels=numels, dtype=dt, device=device)
                          for c, dt in zip(cols, dtypes)]))
    return out


def _grouping(cols: list) -> list:
    """``[(indices, pick, device, dtypes), ...]`` for mixed lists: ``pick(seq)`` is the tuple of ``seq`` at
    ``indices``. Keyed on everything the split reads: each tensor's device and dtypes, and the sizes when
    one is 0."""
    first = cols[0]
    key = (len(first), first.device if first.device is not None else first.devices,
           tuple(c.dtype if c.dtype is not None else c.dtypes for c in cols),
           first.numels if 0 in first.numels else None)
    cached = _groupings.get(key)
    if cached is not None:
        return cached
    groups: dict = {}
    devices = first.devices
    for i, n in enumerate(first.numels):
        if n == 0:
            continue
        groups.setdefault((devices[i],) + tuple(c.dtypes[i] for c in cols), []).append(i)
    result = [(idx, itemgetter(*idx) if len(idx) > 1 else _one(idx[0]), k[0], k[1:]) for k, idx in groups.items()]
    _groupings.put(key, result)
    return result


def _one(i: int):
    return lambda seq: (seq[i],)


def index_on(idx: list[int], device: torch.device) -> torch.Tensor:
    """``idx`` (a list :func:`group` returned) as an int64 tensor on ``device``, uploaded once per list: a
    launcher that gathers a group's per-tensor values indexes with it, not with a Python list (which costs
    a conversion per element and, on a GPU, a blocking copy at every call)."""
    key = (id(idx), device)
    cached = _indices.get(key)
    if cached is not None and cached[0] is idx:
        return cached[1]
    dev = _upload(idx, device)
    _indices.put(key, (idx, dev))
    return dev


def launch(kernel, tab: TensorTable, *args, options: tuple = (), op: str | None = None,
           default_parts: int | None = None, **meta) -> None:
    """Launch ``kernel`` with one program per chunk of ``tab`` (with ``op``, :func:`parts`' grid).

    The kernel's parameters are, in order: ``ptrs, sizes, chunk_tensor, chunk_start, n_tensors``, then
    ``*args``, then one ``tl.constexpr`` dtype per list, then the op's constexprs ``options``, then ``CHUNK``
    and ``BLOCK``, all passed by position: each keyword costs a Triton launch about 2,000 instructions of
    dictionary building and binding. Keyword constexprs (``**meta``) are still accepted, for kernels that
    name theirs (``CHUNK`` and ``BLOCK`` are then passed by name too).

    ``op`` (the kernel's name in :mod:`apex._kernels._tuning`): an element-wise kernel whose last constexpr,
    after ``BLOCK``, is ``PARTS`` (its :func:`chunk_coords` walks ``CHUNK // PARTS`` elements): launched on
    ``parts(op, tab, default_parts=default_parts)``'s grid, ``PARTS`` programs a chunk with its block and warps
    (one cached lookup a table).
    """
    if op is not None:
        programs, n, _, block, warps = parts(op, tab, default_parts=default_parts)
        if meta:
            kernel[(programs,)](tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
                                *args, *tab.dtypes, *options, CHUNK=tab.chunk, BLOCK=block, PARTS=n, **meta,
                                num_warps=warps)
            return
        kernel[(programs,)](tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
                            *args, *tab.dtypes, *options, tab.chunk, block, n, num_warps=warps)
        return
    if meta:
        kernel[(tab.n_chunks,)](
            tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
            *args, *tab.dtypes, *options, CHUNK=tab.chunk, BLOCK=tab.block, **meta,
        )
        return
    kernel[(tab.n_chunks,)](tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
                            *args, *tab.dtypes, *options, tab.chunk, tab.block)


def launch_with_dtypes(kernel, tab: TensorTable, dtypes: tuple, *args, options: tuple = (), **meta) -> None:
    """Like :func:`launch`, with the dtype constexprs given explicitly (for kernels whose number of
    dtype parameters differs from the table's number of lists)."""
    if meta:
        kernel[(tab.n_chunks,)](
            tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
            *args, *dtypes, *options, CHUNK=tab.chunk, BLOCK=tab.block, **meta,
        )
        return
    kernel[(tab.n_chunks,)](tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
                            *args, *dtypes, *options, tab.chunk, tab.block)


@triton.jit
def chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED: tl.constexpr = False, PARTS: tl.constexpr = 1,
                 PART: tl.constexpr = 0):
    """(tensor index, first element of this program's chunk, tensor size) for the current program; with
    ``ALIGNED`` (the table's ``aligned``) the start and size known to the compiler as multiples of 4, so
    that a mask ``idx < n`` is the same over a thread's vector of 4 elements (see :func:`tensor_ptr`).
    ``PARTS`` > 1: a grid of ``PARTS`` programs a chunk, program ``p`` taking the ``PART`` elements (a power of
    two, ``CHUNK / PARTS``) of part ``p % PARTS`` of chunk ``p // PARTS`` (see :func:`parts`)."""
    pid = tl.program_id(0)
    if PARTS > 1:
        t = tl.load(chunk_tensor + pid // PARTS)
        start = tl.load(chunk_start + pid // PARTS) + (pid % PARTS) * PART
    else:
        t = tl.load(chunk_tensor + pid)
        start = tl.load(chunk_start + pid)
    n = tl.load(sizes + t)
    if ALIGNED:
        start = tl.multiple_of(start, 4)
        n = tl.multiple_of(n, 4)
    return t, start, n


_PARTS = _tuning.plan_cache()  # (op, chunks, chunk, id of the dtypes tuple) -> (answer, config, the tuple)
_PARTS_MAX = 256
# Elements of a part in the formula's grid: a chunk of 65536 over 4 programs. One program a chunk, a grid of
# 1,600 chunks (100 tensors of 1 M) is 1.7 waves of Adam's 7 programs an SM on an H200, its last one ~70% full
# (the occupancy model: 87% of the bound; measured: 69% of the copy rate, PyTorch's fused step 82%); 1,000
# tensors of 96 K, whose second chunks are half full, 72%. Parts of 16 K: 93-95%, a program's start (its table
# reads) once per 16 K elements. Kernels light enough for 16 programs an SM (SGD, scale, LAMB's stage 2: 1,600
# programs are under one wave) keep one program a chunk (``default_parts=1``): 4 parts would make 3 waves.
PART_ELEMENTS = 16384


def parts(op: str, tab: TensorTable, default_warps: int = 4, default_parts: int | None = None
          ) -> tuple[int, int, int, int, int]:
    """The launch of ``op`` over ``tab`` as :func:`apex._kernels._tuning.pick` answers for it, ``(programs, PARTS,
    PART, BLOCK, warps)``: the table's chunks each split over ``parts`` programs (a finer grid: the last wave
    of a grid of long programs leaves SMs idle), each walking its part ``block`` elements a step with
    ``warps`` warps. Formula: ``default_parts``, else parts of :data:`PART_ELEMENTS`, on GPUs (one program a
    chunk under the interpreter, whose cost is per program and per step, not per element), the table's
    block, ``default_warps``. The table key is ``(chunks, chunk)``; the answer is kept per key, so a step costs
    one lookup."""
    dtypes = tab.dtypes
    # (the dtypes tuple by identity, kept alive in the entry so that its id stays its own: hashing Triton's
    # dtypes costs ~0.3 µs each, and a table's tuple is the same object at every step)
    key = (op, tab.n_chunks, tab.chunk, id(dtypes))
    got = _PARTS.get(key)
    if got is None or got[2] is not dtypes:
        # (the interpreter's layout walks a chunk in one step: block == chunk)
        if tab.block == tab.chunk:
            n = 1
        else:
            n = default_parts if default_parts is not None else max(1, tab.chunk // PART_ELEMENTS)
        default = {"parts": n, "block": tab.block, "warps": default_warps}
        itemsize = dtypes[1].primitive_bitwidth // 8 if len(dtypes) > 1 else 4
        cfg = _tuning.pick(op, tab.ptrs.device, itemsize, (tab.n_chunks, tab.chunk), default)
        # (a power of two, parts of 4 elements at least, so that they start at multiples of 4 -- the ALIGNED
        # hint -- and never cross a chunk)
        n = max(1, min(_next_pow2(int(cfg["parts"])), tab.chunk // 4))
        part = tab.chunk // n
        if len(_PARTS) >= _PARTS_MAX:
            _PARTS.clear()
        got = _PARTS[key] = ((tab.n_chunks * n, n, part, min(_next_pow2(int(cfg["block"])), part),
                              int(cfg["warps"])), cfg, dtypes)
    else:
        _tuning.last[op] = got[1]  # as pick records it (what a sweep reports)
    return got[0]


@triton.jit
def tensor_ptr(ptrs, list_index, n_tensors, t, DT: tl.constexpr, ALIGNED: tl.constexpr = False):
    """Typed pointer to tensor ``t`` of list ``list_index``; with ``ALIGNED`` known to the compiler as a
    multiple of 4 elements (16 bytes at most, what the table checked). An address read from the table has no
    known alignment, so each element would be its own 4-byte (2-byte) access; told (with
    :func:`chunk_coords`'s start and size), a thread's 4 contiguous elements are one vector access: 16 bytes
    of fp32, 8 of bf16. Every list at 4 elements a vector, so that a table mixing 2- and 4-byte types keeps
    one register layout (8-element bf16 vectors beside 4-element fp32 ones cost a shared-memory layout
    conversion, 4 barriers a pass on sm_90). (The hint is made here, on the value loaded: on a jit
    function's argument it would have no operation to attach to.)"""
    p = tl.load(ptrs + list_index * n_tensors + t).to(tl.pointer_type(DT))
    if ALIGNED:
        p = tl.multiple_of(p, 16 if DT.primitive_bitwidth >= 32 else DT.primitive_bitwidth // 2)
    return p


@triton.jit
def nonfinite(x):
    """True where ``x`` (fp32) is inf or NaN."""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def flag_nonfinite(noop_flag, x, mask):
    """Set ``*noop_flag = 1`` when any unmasked lane of ``x`` is inf or NaN."""
    bad = tl.max((nonfinite(x) & mask).to(tl.int32), axis=0)
    tl.store(noop_flag, bad, mask=bad > 0)
