"""Contiguous memory buffers (Megatron's ``mpu.memory``), allocated on the current accelerator or the CPU.

Misuse raises ``TypeError``/``RuntimeError`` that are also the ``AssertionError`` Apex raised."""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex._errors import AssertRuntimeError, AssertTypeError
from apex.transformer.utils import _current_device


class MemoryBuffer:
    """A flat buffer of ``numel`` elements of ``dtype``; :meth:`add` copies a tensor into the next free
    chunk and returns that chunk as a view, :meth:`reset` frees everything at once."""

    def __init__(self, name: str, numel: int, dtype: torch.dtype, track_usage: bool):
        if dist.is_initialized() and dist.get_rank() == 0:
            size_mb = numel * torch.tensor([], dtype=dtype).element_size() / 1024 / 1024
            print(f"> building the {name} memory buffer with {numel} num elements and {dtype} dtype "
                  f"({size_mb:.1f} MB)...", flush=True)
        self.name = name
        self.numel = numel
        self.dtype = dtype
        self.data = torch.empty(numel, dtype=dtype, device=_current_device(), requires_grad=False)
        self._start = 0
        self.track_usage = track_usage
        if track_usage:
            self.in_use_value = 0.0
            self.total_value = 0.0

    def reset(self) -> None:
        self._start = 0

    def is_in_use(self) -> bool:
        return self._start > 0

    def numel_in_use(self) -> int:
        return self._start

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != self.dtype:
            raise AssertTypeError(f"Input tensor type {tensor.dtype} different from buffer type {self.dtype}")
        new_start = self._start + tensor.numel()
        if new_start > self.numel:
            raise AssertRuntimeError(f"Not enough memory left in the buffer ({tensor.numel()} > "
                                     f"{self.numel - self._start})")
        chunk = self.data[self._start:new_start].view(tensor.shape)
        self._start = new_start
        chunk.copy_(tensor)
        return chunk

    def get_data(self) -> torch.Tensor:
        if self.track_usage:
            self.in_use_value += float(self._start)
            self.total_value += float(self.numel)
        return self.data[:self._start]

    def print_average_usage(self) -> None:
        if not self.track_usage:
            raise AssertRuntimeError("You need to enable track usage.")
        if dist.get_rank() == 0:
            print(f" > usage of {self.name} memory buffer: {self.in_use_value * 100.0 / self.total_value:.2f} %",
                  flush=True)


class _Buffers:
    """Registry of named buffers (one object instead of a module-level dict)."""

    def __init__(self) -> None:
        self.buffers: dict[str, MemoryBuffer] = {}


_REGISTRY = _Buffers()


def allocate_mem_buff(name: str, numel: int, dtype: torch.dtype, track_usage: bool) -> MemoryBuffer:
    """Allocate a named :class:`MemoryBuffer` of ``numel`` elements; ``RuntimeError`` (also the ``AssertionError``
    Apex raised) if the name exists."""
    if name in _REGISTRY.buffers:
        raise AssertRuntimeError(f"memory buffer {name} already allocated.")
    _REGISTRY.buffers[name] = MemoryBuffer(name, numel, dtype, track_usage)
    return _REGISTRY.buffers[name]


def get_mem_buff(name: str) -> MemoryBuffer:
    """The memory buffer allocated under ``name``."""
    return _REGISTRY.buffers[name]


class RingMemBuffer:
    """A ring of ``num_buffers`` buffers handed out in turn."""

    def __init__(self, name: str, num_buffers: int, numel: int, dtype: torch.dtype, track_usage: bool):
        self.num_buffers = num_buffers
        self.buffers = [allocate_mem_buff(f"{name} {i}", numel, dtype, track_usage) for i in range(num_buffers)]
        self._index = -1

    def get_next_buffer(self) -> MemoryBuffer:
        self._index = (self._index + 1) % self.num_buffers
        buff = self.buffers[self._index]
        if buff.is_in_use():
            raise AssertRuntimeError("buffer is already in use.")
        return buff
