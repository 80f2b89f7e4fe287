"""Tensor-parallel mappings: forward and backward of each equal the single-process math (2 and 4 ranks)."""

from __future__ import annotations

import sys

import pytest
import torch

from apex.transformer import parallel_state as ps
from apex.transformer.tensor_parallel import mappings as m
from tests.transformer import _dist


def _full(seed, *shape):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def check_mappings_forward_backward(rank, world):
    for tp in (1, 2, 4):
        if world % tp:
            continue
        ps.initialize_model_parallel(tp)
        r = ps.get_tensor_model_parallel_rank()
        base = ps.get_tensor_model_parallel_src_rank()
        # each rank's own input: a different tensor per tensor-parallel rank
        xs = [_full(10 * (base + i) + 1, 12, 3, 4 * tp) for i in range(tp)]
        gs = [_full(10 * (base + i) + 2, 12, 3, 4 * tp) for i in range(tp)]
        x = xs[r].clone().requires_grad_()
        # copy: identity forward, all-reduced gradient
        y = m.copy_to_tensor_model_parallel_region(x)
        torch.testing.assert_close(y, xs[r])
        y.backward(gs[r])
        torch.testing.assert_close(x.grad, sum(gs))
        # reduce: summed forward, identity gradient; the input is not modified
        x.grad = None
        y = m.reduce_from_tensor_model_parallel_region(x)
        torch.testing.assert_close(y, sum(xs))
        torch.testing.assert_close(x, xs[r])
        y.backward(gs[r])
        torch.testing.assert_close(x.grad, gs[r])
        # scatter (last dim) and gather (last dim) are adjoint
        full = xs[0].clone().requires_grad_()  # the same on all ranks of the group
        y = m.scatter_to_tensor_model_parallel_region(full)
        torch.testing.assert_close(y, xs[0].chunk(tp, dim=-1)[r])
        y.backward(gs[r].chunk(tp, dim=-1)[r])
        torch.testing.assert_close(full.grad, torch.cat([g.chunk(tp, -1)[i] for i, g in enumerate(gs)], -1))
        x.grad = None
        y = m.gather_from_tensor_model_parallel_region(x)
        torch.testing.assert_close(y, torch.cat(xs, dim=-1))
        y.backward(torch.cat(gs, -1))
        torch.testing.assert_close(x.grad, gs[r])
        # sequence parallel: split / gather / reduce-scatter along the first dimension
        full.grad = None
        y = m.scatter_to_sequence_parallel_region(full)
        torch.testing.assert_close(y, xs[0].chunk(tp, 0)[r])
        y.backward(gs[r].chunk(tp, 0)[r])
        torch.testing.assert_close(full.grad, torch.cat([g.chunk(tp, 0)[i] for i, g in enumerate(gs)], 0))
        for to_mp in (True, False):
            x.grad = None
            y = m.gather_from_sequence_parallel_region(x, to_mp)
            torch.testing.assert_close(y, torch.cat(xs, 0))
            grad_y = torch.cat(gs, 0) if not to_mp else torch.cat(gs, 0) * (r + 1)
            y.backward(grad_y)
            if to_mp:
                expect = sum(torch.cat(gs, 0) * (i + 1) for i in range(tp)).chunk(tp, 0)[r]
            else:
                expect = torch.cat(gs, 0).chunk(tp, 0)[r]
            torch.testing.assert_close(x.grad, expect)
        x.grad = None
        y = m.reduce_scatter_to_sequence_parallel_region(x)
        torch.testing.assert_close(y, sum(xs).chunk(tp, 0)[r])
        y.backward(gs[r].chunk(tp, 0)[0])
        torch.testing.assert_close(x.grad, torch.cat([g.chunk(tp, 0)[0] for g in gs], 0))
        # a gradient shared by two consumers is reduced once per consumer, not twice
        a = xs[r].clone().requires_grad_()
        (m.copy_to_tensor_model_parallel_region(a) + m.copy_to_tensor_model_parallel_region(a)).backward(gs[r])
        torch.testing.assert_close(a.grad, 2 * sum(gs))
        if tp > 1:
            with pytest.raises(ValueError, match="not divisible"):
                m.scatter_to_sequence_parallel_region(torch.zeros(tp + 1, 2))
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", _dist.checks_of(sys.modules[__name__]))
def test_distributed(check, world_size, dist_device):
    _dist.assert_check(__name__, check, world_size, dist_device)
