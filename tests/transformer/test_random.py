"""Model-parallel RNG tracker and activation checkpointing: forks replay, ranks differ inside the fork
and agree outside, and checkpoint() with dropout reproduces the uncheckpointed gradients exactly."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from apex.transformer import parallel_state as ps
from apex.transformer import tensor_parallel as tp_
from apex.transformer.tensor_parallel import random as rnd
from tests.transformer import _dist


def test_tracker_fork_and_restore():
    tracker = rnd.CudaRNGStatesTracker()
    torch.manual_seed(1)
    a1, a2 = torch.randn(5), torch.randn(5)
    torch.manual_seed(2)
    b1, b2 = torch.randn(5), torch.randn(5)
    torch.manual_seed(1)
    tracker.add("x", 2)
    torch.testing.assert_close(torch.randn(5), a1)
    with tracker.fork("x"):
        torch.testing.assert_close(torch.randn(5), b1)
    torch.testing.assert_close(torch.randn(5), a2)
    with tracker.fork("x"):
        torch.testing.assert_close(torch.randn(5), b2)
    with pytest.raises(Exception, match="seed 2 already exists"):
        tracker.add("y", 2)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("x", 3)
    with pytest.raises(Exception, match="is not added"):
        with tracker.fork("nope"):
            pass
    states = tracker.get_states()
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.set_states(states)
    assert set(tracker.get_states()) == {"x"}
    state = torch.get_rng_state()
    x = torch.randn(3)
    rnd._set_cuda_rng_state(state)
    torch.testing.assert_close(torch.randn(3), x)


def _block(x, w):
    h = F.dropout(torch.tanh(x @ w), p=0.3)  # default generator: same on all tensor-parallel ranks
    with tp_.get_cuda_rng_tracker().fork():
        h = F.dropout(h, p=0.5)  # tracker's model-parallel generator: differs per tensor-parallel rank
    return h.sum(-1)


def check_checkpoint_replays_dropout(rank, world):
    for tp in (1, world):
        ps.initialize_model_parallel(tp)
        for distribute in (False, True):
            torch.manual_seed(0)
            x0, w0 = torch.randn(4 * tp, 6), torch.randn(6, 6)
            grads = []
            for use_checkpoint in (False, True):
                tp_.model_parallel_cuda_manual_seed(123)
                x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
                if use_checkpoint:
                    y = tp_.checkpoint(_block, distribute, x, w)
                    torch.randn(7)  # the generators move on before the backward
                    with tp_.get_cuda_rng_tracker().fork():
                        torch.randn(7)
                else:
                    y = _block(x, w)
                y.pow(2).sum().backward()
                grads.append((y.detach(), x.grad, w.grad))
            for a, b in zip(*grads):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        # inside the fork ranks differ, outside they agree
        tp_.model_parallel_cuda_manual_seed(9)
        with tp_.get_cuda_rng_tracker().fork():
            inside = torch.randn(8)
        outside = torch.randn(8)
        gathered = [torch.empty(8) for _ in range(world)]
        dist.all_gather(gathered, inside)
        assert (len({tuple(g.tolist()) for g in gathered}) == world) == (tp == world)
        dist.all_gather(gathered, outside)
        assert len({tuple(g.tolist()) for g in gathered}) == 1
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", _dist.checks_of(sys.modules[__name__]))
def test_distributed(check, world_size):
    _dist.assert_check(__name__, check, world_size)
