"""The distributed-check harness of ``tests/transformer/_dist.py`` on 2 Gloo ranks, with this module's own
``check_*`` functions: a check that fails on every rank does not stop the checks after it (the ranks are
still in step), one that fails on some ranks only stops the rest, which say why they did not run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex.transformer import parallel_state as ps
from tests.transformer import _dist

WORLD = 2


def _ranks_in_step(rank, world):
    """An all-reduce every rank enters: the sum of the ranks' ids is right only if they meet in it."""
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t.item()


# The checks run in name order (``_dist.checks_of``).
def check_a_fails_on_every_rank(rank, world):
    ps.initialize_model_parallel(world)
    _ranks_in_step(rank, world)
    raise AssertionError(f"rank {rank} fails on purpose")


def check_b_runs_after_a_failure_on_every_rank(rank, world):
    ps.initialize_model_parallel(world)  # the harness destroyed check_a's groups
    _ranks_in_step(rank, world)


def check_c_fails_on_rank_0_only(rank, world):
    _ranks_in_step(rank, world)
    assert rank != 0, "rank 0 fails on purpose"


def check_d_not_run_after_a_failure_on_some_ranks(rank, world):
    raise AssertionError("must not run: check_c failed on rank 0 only")


def test_failure_on_every_rank_goes_on_failure_on_some_stops():
    res = _dist.run_checks(WORLD, (__name__,))

    def key(check):
        return f"{__name__}:check_{check}"

    assert sorted(res) == [key(n) for n in ("a_fails_on_every_rank", "b_runs_after_a_failure_on_every_rank",
                                            "c_fails_on_rank_0_only", "d_not_run_after_a_failure_on_some_ranks")]
    a = res[key("a_fails_on_every_rank")]
    assert a is not None and all(f"rank {r} fails on purpose" in a for r in range(WORLD)), a
    assert res[key("b_runs_after_a_failure_on_every_rank")] is None
    c = res[key("c_fails_on_rank_0_only")]
    assert c is not None and "--- rank 0" in c and "--- rank 1" not in c, c
    d = res[key("d_not_run_after_a_failure_on_some_ranks")]
    assert d is not None and "must not run" not in d, d
    assert d.count(f"not run: {key('c_fails_on_rank_0_only')} failed on 1 of {WORLD} ranks") == WORLD, d
