"""Splitting helpers of tensor parallelism: last-dimension splits and vocabulary ranges."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from apex.transformer.utils import divide


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Sequence[torch.Tensor]:
    """Split ``tensor`` into ``num_partitions`` equal views along its last dimension (copies made
    contiguous when ``contiguous_split_chunks``). The last dimension must divide evenly (else ``ValueError``,
    also the ``AssertionError`` Apex raised)."""
    chunks = torch.split(tensor, divide(tensor.size(-1), num_partitions), dim=-1)
    if contiguous_split_chunks:
        return tuple(c.contiguous() for c in chunks)
    return chunks


class VocabUtility:
    """The ``[first, last)`` vocabulary ids owned by ``rank`` when the vocabulary is split in
    ``world_size`` equal chunks."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Sequence[int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int, world_size: int) -> Sequence[int]:
        return VocabUtility.vocab_range_from_per_partition_vocab_size(
            divide(global_vocab_size, world_size), rank, world_size)
