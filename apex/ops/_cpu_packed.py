"""Small tensors packed into flat buffers, for CPU steps over many tensors.

A ``torch._foreach_*`` op costs about 1.5 us per tensor on the CPU whatever the tensor's size, which is more
than the arithmetic of a tensor of a few thousand elements. ``Packed`` lays the small tensors of a list
out in flat fp32 buffers, smallest first, so that one op (or one per run of same-sized tensors) covers
all of them; a caller that keeps per-tensor state as views of such a buffer updates that state with one
op. The other tensors are cut into segments small enough to stay in the cache while a step works on
them.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from apex.ops._cpu_blocks import Block, Layout, _Sized, blocks, flat_views, scalar_views

# A tensor of up to this many elements costs more in per-tensor dispatch (about 1.5 us per
# ``torch._foreach_*`` op and tensor) than in arithmetic: ``Packed`` keeps such tensors in flat buffers.
PACK_ELEMENTS = 1 << 12
# Elements per segment of the larger tensors: a step that reads a segment several times finds it in the
# cache (about 4 MiB per fp32 list).
SEGMENT_ELEMENTS = 1 << 20


class Segment(NamedTuple):
    """Consecutive positions ``start:stop`` of ``Packed.perm``: the tensors ``indices`` of the list (also
    as the int64 tensor ``index``); ``take(lst)`` picks them from a list."""

    start: int
    stop: int
    indices: list[int]
    index: torch.Tensor
    take: Callable


class Packed:
    """The small tensors (at most ``PACK_ELEMENTS`` elements) of a list with ``shapes``, packed: flat fp32
    buffers of ``numel`` elements hold them smallest first (``index``: their positions in the list), so
    that one op covers them all and ``class_norms(flat, block, ...)`` norms them a class at a time.
    ``rest``: the other tensors' positions, in order; ``perm = index + rest``. ``segments`` cut ``perm``
    into the packed tensors (when there are any), then runs of the rest of about ``SEGMENT_ELEMENTS``
    elements (a larger tensor is a segment of its own), for steps that finish one segment before the next.

    A caller that keeps per-tensor state as views of a buffer (``adopt``) updates the small tensors' state
    with one op; ``holds`` tells whether a list still is those views (a loaded checkpoint replaces them)."""

    def __init__(self, shapes: Sequence[torch.Size]):
        sizes = [torch.Size(s).numel() for s in shapes]
        small = [i for i, n in enumerate(sizes) if n <= PACK_ELEMENTS]
        layout = Layout([sizes[i] for i in small], max_elements=max(1, sum(sizes[i] for i in small)))
        assert len(layout.blocks) <= 1
        self.block: Block | None = layout.blocks[0] if layout.blocks else None
        self.index = [small[j] for j in layout.perm]
        self.rest = [i for i, n in enumerate(sizes) if n > PACK_ELEMENTS]
        self.perm = self.index + self.rest
        self.numel = layout.numel
        self._shapes = [torch.Size(shapes[i]) for i in self.index]
        parts = [self.index] if self.index else []
        parts += [[self.rest[j] for j in part]
                  for part in blocks([_Sized(sizes[i]) for i in self.rest], SEGMENT_ELEMENTS)]
        self.segments: list[Segment] = []
        at = 0
        for part in parts:
            take = operator.itemgetter(*part)
            self.segments.append(Segment(at, at + len(part), part, torch.tensor(part, dtype=torch.int64),
                                         take if len(part) > 1 else (lambda lst, i=part[0]: (lst[i],))))
            at += len(part)
        self._buffers: dict = {}
        self._scalars: dict = {}

    def buffer(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A flat fp32 buffer of the small tensors and its views, in ``index`` order."""
        if name not in self._buffers:
            self._buffers[name] = flat_views(self._shapes, fill=0.0)
        return self._buffers[name]

    def holds(self, name: str, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` (in ``index`` order) are the views of buffer ``name`` (False before it is
        made)."""
        return name in self._buffers and all(map(operator.is_, tensors, self._buffers[name][1]))

    def adopt(self, name: str, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copy the small ones of ``tensors`` (a whole list, fp32) into buffer ``name``; the list with
        those replaced by the buffer's views."""
        views = self.buffer(name)[1]
        out = list(tensors)
        for i, view in zip(self.index, views):
            t = out[i]
            if t is not view:
                if t.shape != view.shape or t.dtype != view.dtype:
                    raise RuntimeError(f"{name} of tensor {i} is {t.dtype} {tuple(t.shape)}, expected "
                                       f"{view.dtype} {tuple(view.shape)}")
                view.copy_(t)
                out[i] = view
        return out

    def scalars(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One fp32 number per tensor, in ``perm`` order, and its 0-dim views."""
        if name not in self._scalars:
            self._scalars[name] = scalar_views(len(self.perm))
        return self._scalars[name]
