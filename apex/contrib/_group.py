"""Process groups of ``size`` consecutive ranks, for the group batch norms (``groupbn``, ``cudnn_gbn``)."""

from __future__ import annotations

import torch.distributed as dist

from apex._errors import AssertValueError


def consecutive_group(size: int, what: str):
    """The process group of ``size`` consecutive ranks holding this rank (None for ``size == 1``).

    Every rank must call this (``new_group`` is collective). Errors: ``size`` not dividing the world size
    (``ValueError``, also the ``AssertionError`` Apex's ``groupbn`` raised), or ``size > 1`` without an
    initialised process group.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{what}: the group size must be a positive int, got {size!r}")
    if size == 1:
        return None
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} with a group of {size} ranks needs torch.distributed.init_process_group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % size:
        raise AssertValueError(f"{what}: the group size {size} must divide the world size {world}")
    mine = None
    for start in range(0, world, size):
        g = dist.new_group(ranks=list(range(start, start + size)))
        if start <= rank < start + size:
            mine = g
    return mine
