"""The multi-tensor engine: one Triton launch over a whole list of tensors of different sizes.

A :class:`TensorTable` describes ``L`` lists of ``T`` tensors each (list ``l`` holds tensors of one dtype,
all on one device) as device-side int64 tables:

* ``ptrs[l * T + t]``: the address of tensor ``t`` of list ``l``;
* ``sizes[t]``: its number of elements (equal across lists);
* ``chunk_tensor[c]`` / ``chunk_start[c]``: which tensor program ``c`` works on and where its chunk starts.

A kernel written for the engine starts with :func:`chunk_coords` and :func:`tensor_ptr`, and is launched
by :func:`launch` on a grid of one program per chunk. Chunks are ``CHUNK`` elements, a power of two fixed
by the engine (never by Apex's ``chunk_size`` argument), so results do not depend on ``chunk_size``.
Launchers take tensor lists that :func:`group` has split by (device, dtype per list): a call costs one
launch per group, whatever the number of tensors.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

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


@dataclass(frozen=True)
class TensorTable:
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


class _TableCache:
    """Small LRU of device tables keyed on the tensors' addresses and sizes.

    An optimizer step passes the same tensors every step; caching saves the host-side packing and the
    host-to-device copy. The key holds only addresses and sizes, so a hit is valid even if the tensors were
    re-allocated at the same places.
    """

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()

    def get(self, key):
        table = self._entries.get(key)
        if table is not None:
            self._entries.move_to_end(key)
        return table

    def put(self, key, table) -> None:
        self._entries[key] = table
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


_cache = _TableCache()


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def table(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> TensorTable:
    """Build (or fetch from the cache) the device table for lists of equal length, one dtype per list."""
    first = tensor_lists[0]
    device = first[0].device
    sizes = [t.numel() for t in first]
    ptrs = [t.data_ptr() for lst in tensor_lists for t in lst]
    dtypes = tuple(TORCH_TO_TL[lst[0].dtype] for lst in tensor_lists)
    key = (device, dtypes, tuple(ptrs), tuple(sizes))
    cached = _cache.get(key)
    if cached is not None:
        return cached
    chunk = min(MAX_CHUNK, _next_pow2(max(max(sizes), 1)))
    block = chunk if _interpreting() else min(chunk, GPU_BLOCK)
    chunk_tensor: list[int] = []
    chunk_start: list[int] = []
    chunk_first: list[int] = []
    for i, n in enumerate(sizes):
        chunk_first.append(len(chunk_tensor))
        for s in range(0, max(n, 1), chunk):
            chunk_tensor.append(i)
            chunk_start.append(s)
    chunk_first.append(len(chunk_tensor))
    n_t, n_c = len(sizes), len(chunk_tensor)
    # One host buffer, one copy to the device.
    host = torch.tensor(ptrs + sizes + chunk_tensor + chunk_start, dtype=torch.int64)
    dev = host.to(device, non_blocking=False) if device.type != "cpu" else host
    n_p = len(ptrs)
    result = TensorTable(
        ptrs=dev[:n_p],
        sizes=dev[n_p:n_p + n_t],
        chunk_tensor=dev[n_p + n_t:n_p + n_t + n_c].to(torch.int32),
        chunk_start=dev[n_p + n_t + n_c:],
        chunk_first=tuple(chunk_first),
        n_tensors=n_t,
        n_chunks=n_c,
        chunk=chunk,
        block=block,
        dtypes=dtypes,
    )
    _cache.put(key, result)
    return result


def group(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> list[tuple[list[int], list[list[torch.Tensor]]]]:
    """Split lists into groups of tensors sharing (device, dtype of each list).

    Returns ``[(indices, sublists), ...]`` where ``indices`` are positions in the original lists.
    Empty tensors are left out: they need no work.
    """
    groups: dict = {}
    for i in range(len(tensor_lists[0])):
        if tensor_lists[0][i].numel() == 0:
            continue
        key = (tensor_lists[0][i].device,) + tuple(lst[i].dtype for lst in tensor_lists)
        idx, subs = groups.setdefault(key, ([], [[] for _ in tensor_lists]))
        idx.append(i)
        for sub, lst in zip(subs, tensor_lists):
            sub.append(lst[i])
    return list(groups.values())


def launch(kernel, tab: TensorTable, *args, **meta) -> None:
    """Launch ``kernel`` with one program per chunk of ``tab``.

    The kernel's parameters are, in order: ``ptrs, sizes, chunk_tensor, chunk_start, n_tensors``, then
    ``*args``, then one ``tl.constexpr`` dtype per list, then the keyword constexprs of ``**meta``, then
    ``CHUNK`` and ``BLOCK``.
    """
    kernel[(tab.n_chunks,)](
        tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
        *args, *tab.dtypes, CHUNK=tab.chunk, BLOCK=tab.block, **meta,
    )


def launch_with_dtypes(kernel, tab: TensorTable, dtypes: tuple, *args, **meta) -> None:
    """Like :func:`launch`, with the dtype constexprs given explicitly (for kernels whose number of
    dtype parameters differs from the table's number of lists)."""
    kernel[(tab.n_chunks,)](
        tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
        *args, *dtypes, CHUNK=tab.chunk, BLOCK=tab.block, **meta,
    )


@triton.jit
def chunk_coords(sizes, chunk_tensor, chunk_start):
    """(tensor index, first element of this program's chunk, tensor size) for the current program."""
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    n = tl.load(sizes + t)
    return t, start, n


@triton.jit
def tensor_ptr(ptrs, list_index, n_tensors, t, DT: tl.constexpr):
    """Typed pointer to tensor ``t`` of list ``list_index``."""
    return tl.load(ptrs + list_index * n_tensors + t).to(tl.pointer_type(DT))


@triton.jit
def nonfinite(x):
    """True where ``x`` (fp32) is inf or NaN."""
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def flag_nonfinite(noop_flag, x, mask):
    """Set ``*noop_flag = 1`` when any unmasked lane of ``x`` is inf or NaN."""
    bad = tl.max((nonfinite(x) & mask).to(tl.int32), axis=0)
    tl.store(noop_flag, bad, mask=bad > 0)
