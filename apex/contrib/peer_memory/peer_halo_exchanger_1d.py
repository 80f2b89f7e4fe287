"""Apex's ``PeerHaloExchanger1d`` on ``torch.distributed`` send/recv (any backend: NCCL for CUDA tensors, Gloo
for CPU tensors) instead of CUDA IPC peer memory.

The tensor ``y`` is this rank's slice of an activation split along H (or W) across the ranks of ``ranks``,
padded with ``half_halo`` rows on both ends of the split dimension. One call fills the padding in place:

* ``y[low pad]  <- left neighbour's last half_halo interior rows`` (zeros on the first rank of the group),
* ``y[high pad] <- right neighbour's first half_halo interior rows`` (zeros on the last rank),

the interior untouched. Layouts as Apex: ``explicit_nhwc=True`` for (N, H, W, C) tensors, otherwise
(N, C, H, W) in either memory format. Bit-exact for every dtype (data are copied). A neighbour that never
calls makes this rank fail with the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from apex.contrib.peer_memory._halo import check_group_position, exchange_halos
from apex.contrib.peer_memory.peer_memory import PeerMemoryPool


def _split_dim(explicit_nhwc: bool, H_split: bool) -> int:
    if explicit_nhwc:
        return 1 if H_split else 2
    return 2 if H_split else 3


class PeerHaloExchanger1d:
    """Halo exchange between neighbouring ranks of a 1-d spatial split.

    Args:
        ranks: global ranks of the spatial group, in split order.
        rank_in_group: this rank's index in ``ranks``.
        peer_pool: a :class:`PeerMemoryPool` (kept as ``self.peer_pool``; callers ``reset()`` it per step, as
            with Apex; the exchange itself needs no pool memory).
        half_halo: rows of padding on each side of the split dimension.
        group: keyword only, the process group to send/recv in (default: the default group).
    """

    def __init__(self, ranks: Sequence[int], rank_in_group: int, peer_pool: PeerMemoryPool | None,
                 half_halo: int, *, group=None) -> None:
        ranks = check_group_position("PeerHaloExchanger1d", ranks, rank_in_group)
        if isinstance(half_halo, bool) or not isinstance(half_halo, int) or half_halo < 1:
            raise ValueError(f"PeerHaloExchanger1d: half_halo must be a positive int, got {half_halo!r}")
        self.peer_group_size = len(ranks)
        self.ranks = ranks
        self.peer_rank = rank_in_group
        self.low_neighbor = (rank_in_group + self.peer_group_size - 1) % self.peer_group_size
        self.high_neighbor = (rank_in_group + 1) % self.peer_group_size
        self.low_zero = rank_in_group == 0
        self.high_zero = rank_in_group == self.peer_group_size - 1
        self.peer_pool = peer_pool
        self.half_halo = half_halo
        self.group = group

    def __call__(self, y: torch.Tensor, H_split: bool = True, explicit_nhwc: bool = False, numSM: int = 0,
                 diagnostics: bool = False) -> None:
        """Fill ``y``'s ``half_halo`` padding rows on both ends of the split dimension from the neighbours, in
        place. ``numSM`` and ``diagnostics`` tuned Apex's CUDA kernel and are accepted and ignored."""
        if not isinstance(y, torch.Tensor) or y.dim() != 4:
            raise ValueError(f"PeerHaloExchanger1d: y must be a 4-d tensor, got {getattr(y, 'shape', type(y))}")
        dim = _split_dim(explicit_nhwc, H_split)
        hh = self.half_halo
        extent = y.shape[dim] - 2 * hh
        if extent < hh:
            raise ValueError(f"PeerHaloExchanger1d: dimension {dim} of y has {y.shape[dim]} rows; it needs at least "
                             f"{3 * hh} (the interior plus {hh} padding rows each side)")
        low_out = y.narrow(dim, hh, hh)
        low_inp = y.narrow(dim, 0, hh)
        high_out = y.narrow(dim, extent, hh)
        high_inp = y.narrow(dim, extent + hh, hh)
        with torch.no_grad():
            exchange_halos(low_out, high_out, low_inp, high_inp,
                           None if self.low_zero else self.ranks[self.low_neighbor],
                           None if self.high_zero else self.ranks[self.high_neighbor], self.group)
