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

import os
import struct
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from operator import attrgetter, itemgetter, or_

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._lists import column, columns

TORCH_TO_TL = {
    torch.float32: tl.float32,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.float64: tl.float64,
    torch.int32: tl.int32,
    torch.uint8: tl.uint8,
}

# Elements per program. On GPUs a program walks its chunk in BLOCK-wide steps; under the interpreter a
# whole chunk is one step, since the interpreter's cost is per op, not per element.
MAX_CHUNK = 65536
GPU_BLOCK = 1024


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@dataclass(slots=True)
class TensorTable:  # (read-only by convention: a frozen dataclass costs an object.__setattr__ per field)
    ptrs: torch.Tensor          # int64 [n_lists * n_tensors]
    sizes: torch.Tensor         # int64 [n_tensors]
    chunk_tensor: torch.Tensor  # int32 [n_chunks]
    chunk_start: torch.Tensor   # int64 [n_chunks]
    chunk_first: tuple[int, ...]  # host copy: index of the first chunk of each tensor, plus n_chunks
    n_tensors: int
    n_chunks: int
    chunk: int
    block: int
    dtypes: tuple               # triton dtype of each list
    max_chunks: int = 1         # the most chunks of one tensor
    first: torch.Tensor | None = None  # int64 [n_tensors + 1]: chunk_first on the device
    host: bytearray | None = None  # the host bytes ``ptrs`` was uploaded from (never written)
    # Every address a multiple of 16 bytes and every size of 4 elements (chunk starts are: CHUNK is a power of
    # two), so a kernel may access 4 elements a vector (:func:`tensor_ptr`'s ALIGNED); ``rest_aligned``: the
    # same of the sizes and of the lists but the first (what :func:`with_first_list` keeps).
    aligned: bool = False
    rest_aligned: bool = False


@dataclass(frozen=True)
class _Layout:
    """The part of a table that depends only on the tensors' sizes (shared by tables of other addresses)."""

    sizes: torch.Tensor
    chunk_tensor: torch.Tensor
    chunk_start: torch.Tensor
    chunk_first: tuple[int, ...]
    first: torch.Tensor
    n_chunks: int
    chunk: int
    block: int
    max_chunks: int
    sizes_of_4: bool  # every size a multiple of 4 elements


class _LRU:
    """A small least-recently-used map."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()

    def get(self, key):
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


# Tables keyed on (device, dtypes, sizes, addresses): an optimizer passes the same tensors every step, so a
# step costs no packing and no host-to-device copy. Entries hold device tables and facts, never the
# tensors themselves (which may be freed: a hit is valid for any tensors at those places and sizes).
_tables = _LRU()
_layouts = _LRU()
_groupings = _LRU()
_indices = _LRU()
_ranges: dict = {}
# Facts of a sizes tuple by its identity (an optimizer hands its bucket's one tuple every step, whose hash,
# not cached by Python, costs a pass over the sizes): id -> (the tuple, kept so the id stays its own, facts).
_by_sizes: dict = {}
_packers: dict = {}
_col_dtype, _col_key, _col_ptrs = attrgetter("dtype"), attrgetter("key"), attrgetter("ptrs")


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _pack(values: Sequence[int]) -> bytearray:
    """``values`` as native int64 bytes: a struct of their number packs them at half the cost per element of
    ``array("q", values)`` (which parses each through a format string), a third of ``torch.tensor``'s."""
    n = len(values)
    packer = _packers.get(n)
    if packer is None:
        if len(_packers) > 64:
            _packers.clear()
        packer = _packers[n] = struct.Struct(f"{n}q")
    buf = bytearray(packer.size)
    packer.pack_into(buf, 0, *values)
    return buf


def _upload(values, device: torch.device) -> torch.Tensor:
    """An int64 device tensor of ``values`` (ints, or their :func:`_pack` never written again); on a GPU
    through pinned memory without blocking the host (a pageable copy waits for the GPU to drain, and is not
    allowed while a CUDA graph is being captured)."""
    # (the tensor keeps the bytes alive, and nothing writes either, so it needs no copy of its own)
    if type(values) is not bytearray:
        values = _pack(values)
    host = torch.frombuffer(values, dtype=torch.int64) if len(values) else torch.zeros(0, dtype=torch.int64)
    if device.type == "cpu":
        return host
    try:
        host = host.pin_memory()
    except RuntimeError:  # no pinned memory for this device type
        return host.to(device)
    return host.to(device, non_blocking=True)


def _layout(numels: tuple, device: torch.device) -> _Layout:
    held = _by_sizes.get(id(numels))
    if held is not None and held[0] is numels and held[3] is not None and held[2] == device:
        return held[3]
    key = (device, numels)
    cached = _layouts.get(key)
    if cached is not None:
        return _held_layout(numels, device, cached)
    chunk = min(MAX_CHUNK, _next_pow2(max(max(numels), 1)))
    block = chunk if _interpreting() else min(chunk, GPU_BLOCK)
    chunk_tensor: list[int] = []
    chunk_start: list[int] = []
    chunk_first: list[int] = []
    for i, n in enumerate(numels):
        chunk_first.append(len(chunk_tensor))
        if n <= chunk:  # the usual case: one chunk
            chunk_tensor.append(i)
            chunk_start.append(0)
            continue
        for s in range(0, n, chunk):
            chunk_tensor.append(i)
            chunk_start.append(s)
    chunk_first.append(len(chunk_tensor))
    n_t, n_c = len(numels), len(chunk_tensor)
    dev = _upload(list(numels) + chunk_tensor + chunk_start + chunk_first, device)  # one copy
    c0 = n_t + n_c + n_c
    result = _Layout(sizes=dev[:n_t], chunk_tensor=dev[n_t:n_t + n_c].to(torch.int32), chunk_start=dev[n_t + n_c:c0],
                     chunk_first=tuple(chunk_first), first=dev[c0:], n_chunks=n_c, chunk=chunk, block=block,
                     max_chunks=max(1, -(-max(numels) // chunk)), sizes_of_4=not reduce(or_, numels, 0) & 3)
    _layouts.put(key, result)
    return _held_layout(numels, device, result)


def _sizes_facts(numels: tuple) -> list:
    """``[numels, whether none is 0, device of the layout, layout]`` of a sizes tuple, kept by its identity."""
    held = _by_sizes.get(id(numels))
    if held is None or held[0] is not numels:
        if len(_by_sizes) > 64:
            _by_sizes.clear()
        held = _by_sizes[id(numels)] = [numels, 0 not in numels, None, None]
    return held


def _held_layout(numels: tuple, device: torch.device, layout: _Layout) -> _Layout:
    held = _sizes_facts(numels)
    held[2], held[3] = device, layout
    return layout


def table(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> TensorTable:
    """Build (or fetch from the cache) the device table for lists of equal length, one dtype per list.

    Lists may be plain sequences of tensors or :class:`apex._kernels._lists.Column` s (read once by their
    maker); a cached table is reused for any tensors at the same addresses with the same sizes and dtypes.
    """
    cols = columns(tensor_lists)
    first = cols[0]
    device = first.device if first.device is not None else first[0].device
    # (C-level passes over the lists, no generators: a step's hit is this and the LRU lookup)
    dtypes = tuple(map(_col_dtype, cols))
    if None in dtypes:
        dtypes = tuple(c.dtype if c.dtype is not None else c[0].dtype for c in cols)
    # (the sizes are compared on a hit, not hashed: an optimizer hands the same sizes tuple every step)
    key = (device, dtypes, len(first), tuple(map(_col_key, cols)))
    cached = _tables.get(key)
    # (tuples compare their items by identity first: the address tuples an optimizer hands again cost nothing)
    if cached is not None and (cached[0] is first.numels or cached[0] == first.numels) and \
            cached[1] == tuple(map(_col_ptrs, cols)):
        return cached[2]
    lay = _layout(first.numels, device)
    # One upload of every list's addresses, joined on the host from each Column's bytes (made once per
    # Column: a step whose gradients moved packs only theirs; joining them is a copy of bytes), rather
    # than a cached device tensor per list joined by torch.cat: an op and a tensor more per new table.
    host = _host_ptrs(first)
    rest = lay.sizes_of_4
    for c in cols[1:]:
        host = host + _host_ptrs(c)
        rest = rest and _col_aligned16(c)
    result = TensorTable(ptrs=_upload(host, device), sizes=lay.sizes,
                         chunk_tensor=lay.chunk_tensor, chunk_start=lay.chunk_start,
                         chunk_first=lay.chunk_first, n_tensors=len(first), n_chunks=lay.n_chunks,
                         chunk=lay.chunk, block=lay.block, dtypes=tuple(TORCH_TO_TL[d] for d in dtypes),
                         max_chunks=lay.max_chunks, first=lay.first, host=host,
                         aligned=rest and _col_aligned16(first), rest_aligned=rest)
    _tables.put(key, (first.numels, tuple(c.ptrs for c in cols), result))
    return result


def with_first_list(tab: TensorTable, ptrs: Sequence[int]) -> TensorTable:
    """``tab`` (made by :func:`table`) with the addresses of its first list replaced by ``ptrs``, in one upload:
    what a step whose gradients alone moved needs, without the lists' Columns, grouping, hashing and layout
    lookup of a new :func:`table`. The caller promises that the tensors at ``ptrs`` have the first list's
    dtype, device and sizes, in the table's order."""
    n = tab.n_tensors
    if len(ptrs) != n or tab.host is None:
        raise ValueError(f"with_first_list: {len(ptrs)} addresses for a table of {n} tensors")
    first = _pack(ptrs)
    host = first + tab.host[8 * n:]
    return TensorTable(ptrs=_upload(host, tab.ptrs.device), sizes=tab.sizes, chunk_tensor=tab.chunk_tensor,
                       chunk_start=tab.chunk_start, chunk_first=tab.chunk_first, n_tensors=n,
                       n_chunks=tab.n_chunks, chunk=tab.chunk, block=tab.block, dtypes=tab.dtypes,
                       max_chunks=tab.max_chunks, first=tab.first, host=host,
                       aligned=tab.rest_aligned and _aligned16(first), rest_aligned=tab.rest_aligned)


# The byte values whose low four bits are zero: deleted from the addresses' low bytes, they leave nothing
# exactly when every address is a multiple of 16.
_LOW_NIBBLE_ZERO = bytes(range(0, 256, 16))
_LITTLE = sys.byteorder == "little"


def _aligned16(host: bytes | bytearray) -> bool:
    """Whether every int64 address packed in ``host`` (native order, :func:`_pack`) is a multiple of 16 bytes:
    the low byte of each, one C-level slice and translate (~1 ns an address; an ``or`` over the ints
    costs ~50, a fifth of a step's host budget per tensor)."""
    if _LITTLE:
        return not host[0::8].translate(None, _LOW_NIBBLE_ZERO)
    return not reduce(or_, struct.unpack(f"{len(host) // 8}q", host), 0) & 15


def _col_aligned16(col) -> bool:
    """:func:`_aligned16` of a Column's addresses, kept on the Column (its facts never change)."""
    got = col.__dict__.get("aligned16")
    if got is None:
        got = col.aligned16 = _aligned16(_host_ptrs(col))
    return got


def _host_ptrs(col) -> bytearray:
    """A Column's addresses as int64 host bytes, kept on the Column (its facts never change)."""
    host = col.__dict__.get("host_ptrs")
    if host is None:
        host = col.host_ptrs = _pack(col.ptrs)
    return host


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
