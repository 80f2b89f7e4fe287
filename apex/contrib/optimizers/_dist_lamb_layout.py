"""The flat, sharded layout of ``DistributedFusedLAMB`` (upstream's block / chunk / shard layout).

The parameters are laid end to end in one flat buffer of ``total`` elements, padded with zeros to
``pieces * world * piece`` elements, ``pieces = num_blocks * num_chunks``. Piece ``k`` covers the flat range
``[k * world * piece, (k + 1) * world * piece)``; rank ``r`` owns the ``r``-th ``piece``-sized slice of every
piece, so one reduce-scatter per piece hands every rank its slice, and a block (``num_chunks`` consecutive
pieces) can be reduced as soon as the gradients of the parameters it covers are ready. A rank's shard is
its slices of all pieces, end to end: ``pieces * piece`` elements, ``1 / world`` of the padded total.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist


class Fragment(NamedTuple):
    """The part of parameter ``param`` that lies in this rank's shard: ``length`` elements starting at
    element ``param_offset`` of the (flattened) parameter and at ``shard_offset`` of the shard."""

    param: int
    param_offset: int
    shard_offset: int
    length: int


class Layout:
    """Offsets of ``sizes`` (the parameters' element counts) in the padded flat buffer, this rank's
    fragments, and which blocks every parameter touches."""

    def __init__(self, sizes: list[int], world: int, rank: int, num_blocks: int, num_chunks: int):
        assert world >= 1 and 0 <= rank < world and num_blocks >= 1 and num_chunks >= 1
        self.world, self.rank = world, rank
        self.num_blocks, self.num_chunks = num_blocks, num_chunks
        self.pieces = num_blocks * num_chunks
        # the last parameters first: backward usually produces their gradients first, so the first blocks
        # fill (and start their reduce-scatter) while backward still runs
        self.order = list(range(len(sizes)))[::-1]
        self.offsets = [0] * len(sizes)
        total = 0
        for i in self.order:
            self.offsets[i] = total
            total += sizes[i]
        self.sizes = list(sizes)
        self.total = total
        unit = self.pieces * world
        self.piece = max(1, -(-total // unit))
        self.padded = unit * self.piece
        self.shard_numel = self.pieces * self.piece
        self.piece_span = world * self.piece  # flat elements per piece
        self.block_span = num_chunks * self.piece_span
        self.fragments = self._fragments()
        # blocks each parameter touches, and how many parameters each block waits for
        self.param_blocks = []
        self.block_params = [0] * num_blocks
        for off, n in zip(self.offsets, sizes):
            if n == 0:
                self.param_blocks.append(())
                continue
            blocks = tuple(range(off // self.block_span, (off + n - 1) // self.block_span + 1))
            self.param_blocks.append(blocks)
            for b in blocks:
                self.block_params[b] += 1

    def _fragments(self) -> list[Fragment]:
        out = []
        off = [self.offsets[i] for i in self.order]
        end_of = [self.offsets[i] + self.sizes[i] for i in self.order]
        i = 0  # parameters (in self.order) and pieces are both in flat order: one merge pass
        for k in range(self.pieces):
            lo = k * self.piece_span + self.rank * self.piece
            hi = lo + self.piece
            while i < len(off) and end_of[i] <= lo:
                i += 1
            j = i
            while j < len(off) and off[j] < hi:
                start, end = max(lo, off[j]), min(hi, end_of[j])
                if start < end:
                    p = self.order[j]
                    out.append(Fragment(p, start - off[j], k * self.piece + start - lo, end - start))
                j += 1
        return out

    def gather_segments(self) -> list[tuple[int, int, int, int]]:
        """``(param, param_offset, gathered_offset, length)`` runs that cover every parameter once, where
        the all-gather's output is rank after rank (``[rank][piece][slice]``): a parameter's flat range,
        cut at every ``piece`` boundary, is contiguous in that output piece by piece, so the parameters
        are written straight from it without first reordering the whole buffer."""
        out = []
        for i in self.order:
            at, end = self.offsets[i], self.offsets[i] + self.sizes[i]
            while at < end:
                k, within = divmod(at, self.piece_span)
                r, s = divmod(within, self.piece)
                n = min(end - at, self.piece - s)
                out.append((i, at - self.offsets[i], r * self.shard_numel + k * self.piece + s, n))
                at += n
        return out

    def piece_range(self, k: int) -> tuple[int, int]:
        """Flat range of piece ``k`` (the input of its reduce-scatter)."""
        return k * self.piece_span, (k + 1) * self.piece_span

    def block_pieces(self, b: int) -> range:
        return range(b * self.num_chunks, (b + 1) * self.num_chunks)


def shard_groups(dwu_group_size: int | None):
    """``(size, rs_group, ar_group)``: shards over ``size`` consecutive ranks (``dwu_group_size``; 0 or None: the
    world). With several such groups, ``rs_group`` is this rank's (reduce-scatter, norms, all-gather) and
    ``ar_group`` the ranks at the same position in the other groups (the shards' all-reduce); with one, both
    are None (the default group) and no group is created."""
    world, rank = dist.get_world_size(), dist.get_rank()
    size = world if dwu_group_size is None or dwu_group_size <= 0 else int(dwu_group_size)
    if world % size:
        raise ValueError(f"dwu_group_size={dwu_group_size} must divide the world size {world}")
    if size == world:
        return size, None, None
    rs_pg = ar_pg = None
    # new_group is collective: every rank creates every group, in the same order
    for g in range(world // size):
        pg = dist.new_group(ranks=list(range(g * size, (g + 1) * size)))
        if rank // size == g:
            rs_pg = pg
    for i in range(size):
        pg = dist.new_group(ranks=list(range(i, world, size)))
        if rank % size == i:
            ar_pg = pg
    return size, rs_pg, ar_pg
