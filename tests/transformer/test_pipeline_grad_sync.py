"""When the 1F1B schedule enters and leaves ``custom_sync_context_handler``, on 4 Gloo ranks.

Apex's contract (``fwd_bwd_pipelining_without_interleaving``, pinned by its own
``test_pipelining_without_interleaving_with_custom_sync_context_handler``): the context is entered once at the
start and left once; the first pipeline stage leaves it just before its last backward, so that backward runs
with gradient sync on, and every other stage leaves it after all its backwards and then calls
``custom_grad_sync_func``. A context that clears every ``.grad`` on exit therefore leaves gradients on the
first stage only, and those are the gradients of the last microbatch alone.

Each rank runs every scenario in one spawn and records what it saw; the tests assert on those records.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import traceback

import pytest
import torch

from apex.testing import run_distributed
from tests.transformer.test_pipeline import HIDDEN, MBS, SEQ, Stage, _data, _forward_step, _full_layers, _rel

WORLD = 4

# name -> (pipeline-parallel size, microbatches, pass custom_grad_sync_func, forward_only)
SCENARIOS = {
    "pp4_m8_with_sync_func": (4, 8, True, False),
    "pp4_m8_no_sync_func": (4, 8, False, False),
    "pp4_m2_fewer_microbatches_than_stages": (4, 2, True, False),  # every stage is warm-up/cool-down only
    "pp2_dp2_m4_with_sync_func": (2, 4, True, False),  # Apex's own test's layout on 4 devices
    "pp4_m3_forward_only": (4, 3, True, True),
}


def _last_microbatch_grads(num_microbatches: int, first: int, count: int) -> list[torch.Tensor]:
    """Gradients of the last microbatch's ``loss / num_microbatches`` for layers ``[first, first + count)``."""
    layers = _full_layers()
    x, y = _data(num_microbatches)
    rows = slice((num_microbatches - 1) * MBS, num_microbatches * MBS)
    loss = (Stage(layers, True, True)(x[rows]) - y[rows].transpose(0, 1)).pow(2).mean()
    (loss / num_microbatches).backward()
    return [p.grad for layer in layers[first:first + count] for p in layer.parameters()]


def _scenario(rank: int, pp: int, num_microbatches: int, with_sync_func: bool, forward_only: bool) -> dict:
    from apex.transformer import parallel_state
    from apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving import (
        forward_backward_pipelining_without_interleaving,
    )
    from apex.transformer.pipeline_parallel.utils import _reconfigure_microbatch_calculator

    parallel_state.initialize_model_parallel(1, pp)
    dp = parallel_state.get_data_parallel_world_size()
    _reconfigure_microbatch_calculator(rank, None, num_microbatches * MBS * dp, MBS, dp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    per = len(_full_layers()) // pp
    model = Stage(_full_layers()[pp_rank * per:(pp_rank + 1) * per], pp_rank == 0, pp_rank == pp - 1)
    events: list[str] = []

    class ClearingContext:
        """Stands in for a data-parallel no-sync context: dropping the gradients on exit makes any backward
        that ran inside it visible as a missing ``.grad``."""

        def __enter__(self):
            events.append("enter")

        def __exit__(self, *exc):
            events.append("exit")
            for p in model.parameters():
                p.grad = None

    def sync_func():
        events.append("sync_func")

    forward_backward_pipelining_without_interleaving(
        _forward_step, _data(num_microbatches), model, forward_only=forward_only, tensor_shape=(SEQ, MBS, HIDDEN),
        custom_sync_context_handler=ClearingContext, custom_grad_sync_func=sync_func if with_sync_func else None)
    grads = [p.grad for p in model.parameters()]
    record = {"pp_rank": pp_rank, "events": events, "grads_set": [g is not None for g in grads], "rel_err": None}
    if all(g is not None for g in grads):
        refs = _last_microbatch_grads(num_microbatches, pp_rank * per, per)
        record["rel_err"] = max(_rel(g, r) for g, r in zip(grads, refs))
    return record


def _all_scenarios(rank: int, world_size: int, out_dir: str) -> None:
    from apex.transformer import parallel_state

    records = {}
    for name, args in SCENARIOS.items():
        try:
            records[name] = _scenario(rank, *args)
        except BaseException:  # noqa: BLE001 - recorded and re-raised by the test
            records[name] = {"error": traceback.format_exc()}
        finally:
            parallel_state.destroy_model_parallel()
        failed = torch.tensor([float("error" in records[name])])
        torch.distributed.all_reduce(failed)
        if failed.item():  # ranks may be out of step now: stop rather than hang
            break
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)


@functools.cache
def _records() -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        run_distributed(_all_scenarios, WORLD, d, timeout_s=20.0)
        out = []
        for rank in range(WORLD):
            with open(os.path.join(d, f"rank{rank}.json")) as f:
                out.append(json.load(f))
    return out


def _per_rank(name: str) -> list[dict]:
    recs = [r.get(name) for r in _records()]
    assert all(r is not None for r in recs), f"{name} did not run (an earlier scenario failed)"
    errors = [f"--- rank {k}\n{r['error']}" for k, r in enumerate(recs) if "error" in r]
    if errors:
        raise AssertionError("\n".join(errors))
    return recs


@pytest.mark.parametrize("name", [n for n, s in SCENARIOS.items() if not s[3]])
def test_gradients_survive_only_on_first_stage(name):
    """The backward run with sync enabled is the first stage's last one, and only that one."""
    for rank, rec in enumerate(_per_rank(name)):
        first = rec["pp_rank"] == 0
        assert rec["grads_set"] == [first] * len(rec["grads_set"]), (
            f"rank {rank} (pipeline stage {rec['pp_rank']}): expected gradients "
            f"{'on every parameter' if first else 'on none'}, got {rec['grads_set']}")
        if first:
            assert rec["rel_err"] <= 1e-6, f"rank {rank}: gradients are not the last microbatch's: {rec['rel_err']}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_context_entered_and_left_once_then_grad_sync_func(name):
    """One enter, one exit; ``custom_grad_sync_func`` after the exit on every stage but the first."""
    _, _, with_sync_func, forward_only = SCENARIOS[name]
    for rank, rec in enumerate(_per_rank(name)):
        expected = ["enter", "exit"]
        if with_sync_func and not forward_only and rec["pp_rank"] != 0:
            expected.append("sync_func")
        assert rec["events"] == expected, f"rank {rank} (pipeline stage {rec['pp_rank']}): {rec['events']}"
