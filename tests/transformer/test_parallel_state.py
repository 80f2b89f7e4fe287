"""parallel_state: Megatron's group layout (pure function, any world size) and every getter on 2 and 4
Gloo ranks for TP x PP in {1, 2, 4}^2; errors; a stalled rank gives the process group's timeout."""

from __future__ import annotations

import itertools
import sys

import pytest
import torch
import torch.distributed as dist

from apex.testing import run_distributed
from apex.testing.distributed import stall_rank_one, stalled_outcome
from apex.transformer import parallel_state as ps
from tests.transformer import _dist


def _expected_ranks(rank: int, world: int, tp: int, pp: int) -> dict:
    """Independent formulas for this rank's coordinates (Megatron: tensor fastest, then data, then pipeline)."""
    block = world // pp
    return {"tp": rank % tp, "pp": rank // block, "dp": (rank % block) // tp}


@pytest.mark.parametrize("world", [1, 2, 4, 8, 16, 32, 64])
def test_layout_partitions_the_world(world):
    for tp, pp in itertools.product([1, 2, 4, 8], [1, 2, 4, 8]):
        if world % (tp * pp):
            continue
        lay = ps.group_layout(world, tp, pp)
        dp = world // (tp * pp)
        for kind, size in (("tensor", tp), ("pipeline", pp), ("data", dp), ("model", tp * pp)):
            groups = getattr(lay, kind)
            assert all(len(g) == size for g in groups), kind
            assert sorted(r for g in groups for r in g) == list(range(world)), kind
        for rank in range(world):
            exp = _expected_ranks(rank, world, tp, pp)
            t = next(g for g in lay.tensor if rank in g)
            p = next(g for g in lay.pipeline if rank in g)
            d = next(g for g in lay.data if rank in g)
            assert t.index(rank) == exp["tp"] and p.index(rank) == exp["pp"] and d.index(rank) == exp["dp"]
        for p, emb in zip(lay.pipeline, lay.embedding):
            assert emb == ([p[0], p[-1]] if pp > 1 else p)


def test_layout_matches_megatron_docstring():
    lay = ps.group_layout(16, 2, 4)
    assert lay.data == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert lay.tensor == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert lay.pipeline == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert lay.model[0] == [0, 1, 4, 5, 8, 9, 12, 13]
    split = ps.group_layout(8, 1, 8, pipeline_model_parallel_split_rank=3)
    assert split.embedding[0] == [0, 3, 7] and split.position_embedding[0] == [0, 3]
    assert split.encoder_relative_position_embedding[0] == [0, 1, 2]
    assert split.decoder_relative_position_embedding[0] == [3, 4, 5, 6, 7]
    assert ps.group_layout(8, 2, 1, use_fp8=True).amax == [[0, 1, 2, 3, 4, 5, 6, 7]]


def test_layout_rejects_indivisible_world():
    with pytest.raises(RuntimeError, match=r"\(6\).*\(4\).*\(1\)"):
        ps.group_layout(6, 4, 1)


def test_getters_before_initialization_raise():
    assert not ps.model_parallel_is_initialized()
    for getter in (ps.get_tensor_model_parallel_group, ps.get_data_parallel_group, ps.get_pipeline_model_parallel_group,
                   ps.get_model_parallel_group, ps.get_embedding_group, ps.get_pipeline_model_parallel_first_rank):
        with pytest.raises(RuntimeError, match="not initialized"):
            getter()
    with pytest.raises(AssertionError):  # upstream asserted: callers catching AssertionError still work
        ps.get_tensor_model_parallel_group()
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ps.initialize_model_parallel(1)


# ------------------------------------------------------------------------------ distributed checks
def check_layout_and_getters(rank, world):
    for tp, pp in itertools.product([1, 2, 4], [1, 2, 4]):
        if world % (tp * pp):
            continue
        ps.initialize_model_parallel(tp, pp, default_backend="nccl", p2p_backend=None)
        lay = ps.group_layout(world, tp, pp)
        exp = _expected_ranks(rank, world, tp, pp)
        msg = f"tp={tp} pp={pp} rank={rank}"
        assert ps.model_parallel_is_initialized()
        assert ps.get_tensor_model_parallel_world_size() == tp, msg
        assert ps.get_pipeline_model_parallel_world_size() == pp, msg
        assert ps.get_data_parallel_world_size() == world // (tp * pp), msg
        assert ps.get_tensor_model_parallel_rank() == exp["tp"], msg
        assert ps.get_pipeline_model_parallel_rank() == exp["pp"], msg
        assert ps.get_data_parallel_rank() == exp["dp"], msg
        assert ps.get_rank_info() == (exp["dp"], exp["tp"], exp["pp"], None)
        for getter, kind in ((ps.get_tensor_model_parallel_group, "tensor"), (ps.get_data_parallel_group, "data"),
                             (ps.get_pipeline_model_parallel_group, "pipeline"), (ps.get_model_parallel_group, "model"),
                             (ps.get_embedding_group, "embedding")):
            mine = next((g for g in getattr(lay, kind) if rank in g), None)
            if mine is None:  # middle pipeline stages hold no embedding
                assert kind == "embedding" and 0 < exp["pp"] < pp - 1, msg
                continue
            assert dist.get_process_group_ranks(getter()) == mine, (msg, kind)
            # the group really communicates among exactly those ranks
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=getter())
            assert t.item() == sum(mine), (msg, kind)
        pipe = next(g for g in lay.pipeline if rank in g)
        assert ps.get_tensor_model_parallel_src_rank() == rank - exp["tp"], msg
        assert ps.get_data_parallel_src_rank() == next(g for g in lay.data if rank in g)[0], msg
        assert ps.get_pipeline_model_parallel_first_rank() == pipe[0]
        assert ps.get_pipeline_model_parallel_last_rank() == pipe[-1]
        assert ps.get_pipeline_model_parallel_next_rank() == pipe[(exp["pp"] + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == pipe[(exp["pp"] - 1) % pp]
        assert ps.is_pipeline_first_stage() == (exp["pp"] == 0)
        assert ps.is_pipeline_last_stage() == (exp["pp"] == pp - 1)
        assert ps.is_rank_in_embedding_group() == (exp["pp"] in (0, pp - 1))
        assert ps.is_rank_in_position_embedding_group() == (exp["pp"] == 0)
        assert ps.is_pipeline_stage_before_split() and ps.is_pipeline_stage_after_split()
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()


def check_virtual_and_split(rank, world):
    if world < 4:
        return
    ps.initialize_model_parallel(1, 4, 2, 2)
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    assert ps.get_pipeline_model_parallel_split_rank() == 2
    pp_rank = ps.get_pipeline_model_parallel_rank()
    assert ps.is_rank_in_encoder_relative_position_embedding_group() == (pp_rank < 2)
    assert ps.is_rank_in_decoder_relative_position_embedding_group() == (pp_rank >= 2)
    assert ps.is_pipeline_stage_before_split() == (pp_rank < 2)
    assert ps.is_pipeline_stage_after_split() == (pp_rank >= 2)
    assert ps.is_pipeline_stage_at_split() == (pp_rank == 1)
    assert ps.is_rank_in_embedding_group(ignore_virtual=True) == (pp_rank in (0, 2, 3))
    # virtual stages: only virtual rank 0 of stage 0 is "first", only the last virtual rank of the last stage "last"
    ps.set_virtual_pipeline_model_parallel_rank(1)
    assert not ps.is_pipeline_first_stage() and ps.is_pipeline_first_stage(ignore_virtual=True) == (pp_rank == 0)
    assert ps.is_pipeline_last_stage() == (pp_rank == 3)
    ps.set_pipeline_model_parallel_split_rank(77)
    assert ps.get_pipeline_model_parallel_split_rank() == 77
    ps.set_tensor_model_parallel_world_size(8)
    ps.set_tensor_model_parallel_rank(5)
    assert ps.get_tensor_model_parallel_world_size() == 8 and ps.get_tensor_model_parallel_rank() == 5
    ps.destroy_model_parallel()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None


def check_bad_input_changes_nothing(rank, world):
    import pytest as _pytest

    tp, pp = (3, 1) if world == 4 else (2, 2)
    with _pytest.raises(RuntimeError, match=rf"\({world}\) is not divisible by tensor_model_parallel_size \({tp}\)"):
        ps.initialize_model_parallel(tp, pp)
    assert not ps.model_parallel_is_initialized() and ps.is_unitialized()
    with _pytest.raises(ValueError, match="split_rank"):
        ps.initialize_model_parallel(1, world, None, world)
    with _pytest.raises(RuntimeError, match="greater than 2"):
        ps.initialize_model_parallel(1, 2, 2)
    with _pytest.raises(ValueError, match="tensor_model_parallel_size_"):
        ps.initialize_model_parallel(0)
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None and ps.is_unitialized()
    ps.initialize_model_parallel(world)
    with _pytest.raises(RuntimeError, match="already initialized"):
        ps.initialize_model_parallel(1)
    assert ps.get_tensor_model_parallel_world_size() == world


def check_apex_module_globals(rank, world):
    """Apex's module globals (``_DATA_PARALLEL_GROUP``, ``_PIPELINE_GLOBAL_RANKS``, ...) read the live state,
    and assigning one changes what the getters answer, as it did in Apex."""
    assert ps._TENSOR_MODEL_PARALLEL_GROUP is None and ps._PIPELINE_GLOBAL_RANKS is None
    ps.initialize_model_parallel(2, world // 2)
    try:
        assert ps._TENSOR_MODEL_PARALLEL_GROUP is ps.get_tensor_model_parallel_group()
        assert ps._DATA_PARALLEL_GROUP is ps.get_data_parallel_group()
        assert ps._PIPELINE_MODEL_PARALLEL_GROUP is ps.get_pipeline_model_parallel_group()
        assert ps._MODEL_PARALLEL_GROUP is ps.get_model_parallel_group()
        assert ps._PIPELINE_GLOBAL_RANKS == dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
        assert ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None and ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK is None
        ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = 8
        ps._MPU_TENSOR_MODEL_PARALLEL_RANK = 5
        ps._PIPELINE_MODEL_PARALLEL_SPLIT_RANK = 1
        assert ps.get_tensor_model_parallel_world_size() == 8 and ps.get_tensor_model_parallel_rank() == 5
        assert ps.get_pipeline_model_parallel_split_rank() == 1
        assert "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE" not in vars(ps)  # no shadowing module attribute
    finally:
        ps.destroy_model_parallel()
    assert ps._TENSOR_MODEL_PARALLEL_GROUP is None and ps._MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is None
    with pytest.raises(AttributeError):
        ps._NOT_AN_APEX_GLOBAL  # noqa: B018


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", _dist.checks_of(sys.modules[__name__]))
def test_distributed(check, world_size):
    _dist.assert_check(__name__, check, world_size)


# --------------------------------------------------------------------------- a stalled rank
def _stalled_rank(rank, world, out_dir):
    ps.initialize_model_parallel(world)
    stall_rank_one(rank, out_dir, lambda: dist.all_reduce(torch.ones(3), group=ps.get_tensor_model_parallel_group()))


def test_stalled_rank_times_out(tmp_path):
    # 6 s: short, yet long enough for the group set-up on a loaded machine
    run_distributed(_stalled_rank, 2, str(tmp_path), timeout_s=6.0)
    elapsed, outcome = stalled_outcome(tmp_path)
    assert "timed out" in outcome.lower() or "timeout" in outcome.lower(), outcome
    assert elapsed < 15.0  # the group's 6 s timeout, not torch's 30-minute default

