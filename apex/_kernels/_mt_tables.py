"""The multi-tensor engine's tables (:mod:`apex._kernels.multi_tensor` launches with them): the device-side
int64 tables of addresses, sizes and chunk coordinates that describe lists of tensors to one launch, made once
per (device, dtypes, sizes, addresses) and cached, with the layout part (sizes and chunks) shared by tables of
other addresses. See :mod:`apex._kernels.multi_tensor` for the tables' fields.
"""

from __future__ import annotations

import os
import struct
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from operator import attrgetter, or_

import torch
import triton.language as tl

from apex._kernels._lists import columns

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
