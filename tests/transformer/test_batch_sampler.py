"""Megatron batch samplers: coverage, data-parallel sharding and resume from consumed_samples."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.transformer._data import MegatronPretrainingRandomSampler, MegatronPretrainingSampler


@settings(max_examples=25, deadline=None)
@given(total=st.integers(1, 60), lmb=st.integers(1, 5), dp=st.integers(1, 3), consumed=st.integers(0, 59),
       drop_last=st.booleans())
def test_sequential_sharding(total, lmb, dp, consumed, drop_last):
    if consumed >= total:
        with pytest.raises(ValueError, match="no samples left"):
            MegatronPretrainingSampler(total, consumed, lmb, 0, dp, drop_last)
        return
    per_rank = [list(MegatronPretrainingSampler(total, consumed, lmb, r, dp, drop_last)) for r in range(dp)]
    seen = sorted(i for batches in per_rank for b in batches for i in b)
    chunk = lmb * dp
    full_end = consumed + ((total - consumed) // chunk) * chunk
    assert seen == list(range(consumed, full_end if drop_last else total))
    for r, batches in enumerate(per_rank):
        for j, b in enumerate(batches):
            start = consumed + j * chunk + r * lmb
            assert b == list(range(start, min(start + lmb, total)))


def test_sequential_dp1_matches_plain_chunks():
    got = list(MegatronPretrainingSampler(10, 3, 3, 0, 1, drop_last=False))
    assert got == [[3, 4, 5], [6, 7, 8], [9]]
    assert list(MegatronPretrainingSampler(10, 3, 3, 0, 1)) == [[3, 4, 5], [6, 7, 8]]


def _random_all(total, consumed, lmb, dp):
    return [MegatronPretrainingRandomSampler(total, consumed, lmb, r, dp) for r in range(dp)]


@settings(max_examples=20, deadline=None)
@given(total=st.integers(4, 60), lmb=st.integers(1, 4), dp=st.integers(1, 3), stop=st.integers(0, 5))
def test_random_resume(total, lmb, dp, stop):
    if total < lmb * dp:
        with pytest.raises(ValueError, match="smaller than one global batch"):
            MegatronPretrainingRandomSampler(total, 0, lmb, 0, dp)
        return
    for r in range(dp):
        full = list(MegatronPretrainingRandomSampler(total, 0, lmb, r, dp))
        assert all(len(b) == lmb for b in full)
        bucket = (total // (lmb * dp)) * lmb
        flat = [i for b in full for i in b]
        assert sorted(flat) == list(range(r * bucket, (r + 1) * bucket))  # a permutation of the rank's bucket
        k = min(stop, len(full) - 1)  # resuming at len(full) starts the next epoch (tested below)
        resumed = list(MegatronPretrainingRandomSampler(total, k * lmb * dp, lmb, r, dp))
        assert resumed == full[k:]


def test_random_consumed_counts_and_next_epoch():
    s = MegatronPretrainingRandomSampler(10, 0, 2, 0, 2)  # 8 active samples, 4 per rank
    epoch0 = list(s)
    assert s.consumed_samples == 8 and len(epoch0) == 2
    epoch1 = list(s)
    assert s.epoch == 1 and sorted(i for b in epoch1 for i in b) == [0, 1, 2, 3]
    g = torch.Generator().manual_seed(1)
    assert [i for b in epoch1 for i in b] == torch.randperm(4, generator=g).tolist()


def test_local_minibatch_size_setter():
    s = MegatronPretrainingSampler(20, 0, 2, 1, 2)
    it = iter(s)
    assert next(it) == [2, 3]
    s.local_minibatch_size = 3  # ramp-up: the next chunk is 6 samples
    assert s.local_minibatch_times_data_parallel_size == 6
    assert next(it) == [7, 8, 9]
    with pytest.raises(ValueError, match="local_minibatch_size"):
        s.local_minibatch_size = 0


@pytest.mark.parametrize("cls", [MegatronPretrainingSampler, MegatronPretrainingRandomSampler])
@pytest.mark.parametrize("args,match", [
    ((0, 0, 2, 0, 1), "total_samples|no sample"),
    ((10, 0, 0, 0, 1), "local_minibatch_size"),
    ((10, 0, 2, 0, 0), "data_parallel_size"),
    ((10, 0, 2, 2, 2), "data_parallel_rank"),
])
def test_bad_input(cls, args, match):
    with pytest.raises(ValueError, match=match):
        cls(*args)


def test_dataloader_integration():
    data = torch.arange(12.0)
    loader = torch.utils.data.DataLoader(data, batch_sampler=MegatronPretrainingSampler(12, 4, 2, 0, 1))
    assert [b.tolist() for b in loader] == [[4.0, 5.0], [6.0, 7.0], [8.0, 9.0], [10.0, 11.0]]
