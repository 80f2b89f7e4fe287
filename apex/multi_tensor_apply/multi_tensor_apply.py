"""Apex's ``MultiTensorApply``: calls an ``amp_C`` op with a fixed ``chunk_size``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class MultiTensorApply:
    """``applier(op, noop_flag_buffer, tensor_lists, *args)`` runs ``op(chunk_size, noop_flag_buffer,
    tensor_lists, *args)``. Every op works on CPU and GPU tensors, so ``available`` is always True."""

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        if not MultiTensorApply.available:
            raise RuntimeError("Attempted to call MultiTensorApply method, but MultiTensorApply "
                               "is not available.")

    def __call__(self, op: Callable, noop_flag_buffer: torch.Tensor,
                 tensor_lists: Sequence[Sequence[torch.Tensor]], *args):
        self.check_avail()
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)
