"""Megatron-style batch samplers yielding one data-parallel rank's local minibatch of dataset indices.

Both resume from ``consumed_samples`` (the number of samples all data-parallel ranks together have used),
so a restarted job continues exactly where it stopped. ``local_minibatch_size`` is
``global_batch_size / data_parallel_size``; it can be reassigned between iterations (batch-size ramp-up).

Bad arguments raise ``ValueError`` that is also the ``RuntimeError`` Apex's ``MegatronPretrainingSampler``
raised (its random sampler raised ``ValueError``), so code written for either catches them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from apex._errors import RuntimeValueError

__all__ = ["MegatronPretrainingSampler", "MegatronPretrainingRandomSampler"]


def _check_common(total_samples, local_minibatch_size, data_parallel_rank, data_parallel_size) -> None:
    if total_samples <= 0:
        raise RuntimeValueError(f"no sample to consume: total_samples of {total_samples}")
    if local_minibatch_size <= 0:
        raise RuntimeValueError(f"local_minibatch_size must be greater than 0, got {local_minibatch_size}")
    if data_parallel_size <= 0:
        raise RuntimeValueError(f"data_parallel_size must be greater than 0, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise RuntimeValueError(
            f"data_parallel_rank must be in [0, data_parallel_size={data_parallel_size}), got {data_parallel_rank}"
        )


class _Base:
    def __init__(self, total_samples, consumed_samples, local_minibatch_size, data_parallel_rank, data_parallel_size):
        _check_common(total_samples, local_minibatch_size, data_parallel_rank, data_parallel_size)
        if consumed_samples < 0:
            raise RuntimeValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.local_minibatch_size = local_minibatch_size

    def __len__(self) -> int:
        return self.total_samples

    @property
    def local_minibatch_size(self) -> int:
        return self._local_minibatch_size

    @local_minibatch_size.setter
    def local_minibatch_size(self, new_local_minibatch_size: int) -> None:
        if new_local_minibatch_size <= 0:
            raise RuntimeValueError(f"local_minibatch_size must be greater than 0, got {new_local_minibatch_size}")
        self._local_minibatch_size = new_local_minibatch_size
        self.local_minibatch_times_data_parallel_size = new_local_minibatch_size * self.data_parallel_size


class MegatronPretrainingSampler(_Base):
    """Sequential sampler: indices ``consumed_samples, consumed_samples+1, ...`` in global chunks of
    ``local_minibatch_size * data_parallel_size``; rank ``r`` gets the ``r``-th slice of each chunk.

    A final partial chunk is dropped when ``drop_last`` (else each rank gets its part of it, possibly empty
    parts are skipped).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        local_minibatch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        if 0 < total_samples <= consumed_samples:  # total_samples <= 0 is reported first (Apex's order)
            raise RuntimeValueError(f"no samples left to consume: consumed_samples {consumed_samples} >= "
                                    f"{total_samples}")
        super().__init__(total_samples, consumed_samples, local_minibatch_size, data_parallel_rank, data_parallel_size)
        self.drop_last = drop_last

    def get_start_end_idx(self) -> tuple:
        start_idx = self.data_parallel_rank * self.local_minibatch_size
        return start_idx, start_idx + self.local_minibatch_size

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed_samples
        while start < self.total_samples:
            chunk = self.local_minibatch_times_data_parallel_size  # re-read: the size may change between yields
            end = min(start + chunk, self.total_samples)
            if end - start < chunk and self.drop_last:
                return
            lo, hi = self.get_start_end_idx()
            part = list(range(start + lo, min(start + hi, end)))
            start = end
            if part:
                yield part


class MegatronPretrainingRandomSampler(_Base):
    """Random sampler: each rank owns a contiguous bucket of
    ``(total_samples // (local_minibatch_size * dp)) * local_minibatch_size`` indices and walks a permutation of
    it seeded with the epoch number; ``consumed_samples`` (advanced by ``local_minibatch_size * dp`` per yielded
    batch) picks the epoch and the offset into the permutation. Incomplete last batches are dropped.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        local_minibatch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
    ) -> None:
        super().__init__(total_samples, consumed_samples, local_minibatch_size, data_parallel_rank, data_parallel_size)
        if total_samples < self.local_minibatch_times_data_parallel_size:
            raise RuntimeValueError(
                f"total_samples ({total_samples}) is smaller than one global batch "
                f"({local_minibatch_size} * {data_parallel_size})"
            )
        self.last_batch_size = total_samples % self.local_minibatch_times_data_parallel_size

    def __iter__(self) -> Iterator[list[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        bucket_size = (self.total_samples // self.local_minibatch_times_data_parallel_size) * self.local_minibatch_size
        bucket_offset = current_epoch_samples // self.data_parallel_size
        start_idx = self.data_parallel_rank * bucket_size
        g = torch.Generator()
        g.manual_seed(self.epoch)
        random_idx = torch.randperm(bucket_size, generator=g).tolist()
        batch: list[int] = []
        for x in random_idx[bucket_offset:]:
            batch.append(start_idx + x)
            if len(batch) == self.local_minibatch_size:
                self.consumed_samples += self.local_minibatch_times_data_parallel_size
                yield batch
                batch = []
