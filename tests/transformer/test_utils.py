"""apex.transformer.utils and tensor_parallel.utils: divisibility, splits, 1-D chunking, vocabulary ranges."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from apex.transformer import log_util
from apex.transformer import parallel_state as ps
from apex.transformer import utils as tu
from apex.transformer.tensor_parallel.utils import VocabUtility, split_tensor_along_last_dim
from tests.transformer import _dist


def test_divide():
    assert tu.divide(12, 4) == 3
    with pytest.raises(ValueError, match="13 is not divisible by 4"):
        tu.divide(13, 4)
    with pytest.raises(ValueError, match="is not divisible by 0"):
        tu.ensure_divisibility(3, 0)


def test_split_tensor_along_last_dim():
    x = torch.randn(3, 5, 12).transpose(0, 1)
    parts = split_tensor_along_last_dim(x, 4)
    assert [p.shape[-1] for p in parts] == [3] * 4
    torch.testing.assert_close(torch.cat(parts, -1), x)
    assert all(p.is_contiguous() for p in split_tensor_along_last_dim(x, 4, contiguous_split_chunks=True))
    with pytest.raises(ValueError, match="12 is not divisible by 5"):
        split_tensor_along_last_dim(x, 5)


def test_vocab_utility():
    assert VocabUtility.vocab_range_from_global_vocab_size(100, 3, 4) == (75, 100)
    assert VocabUtility.vocab_range_from_per_partition_vocab_size(7, 2, 4) == (14, 21)
    with pytest.raises(ValueError):
        VocabUtility.vocab_range_from_global_vocab_size(10, 0, 4)


def test_logger_level():
    logger = log_util.get_transformer_logger("apex.transformer.something.py")
    assert logger.name == "apex.transformer.something"
    old = logging.getLogger("apex").level
    try:
        log_util.set_logging_level(logging.ERROR)
        assert logger.getEffectiveLevel() == logging.ERROR
    finally:
        logging.getLogger("apex").setLevel(old)


def check_1d_chunks_roundtrip(rank, world):
    for tp in (1, 2, 4):
        if world % tp:
            continue
        ps.initialize_model_parallel(tp)
        x = torch.arange(4.0 * 6 * tp).view(4, 6 * tp) + ps.get_tensor_model_parallel_src_rank()
        chunk = tu.split_tensor_into_1d_equal_chunks(x)
        assert chunk.numel() == x.numel() // tp
        torch.testing.assert_close(tu.gather_split_1d_tensor(chunk), x.view(-1))
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", _dist.checks_of(sys.modules[__name__]))
def test_distributed(check, world_size):
    _dist.assert_check(__name__, check, world_size)
