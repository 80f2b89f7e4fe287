"""Behaviour every fused optimizer shares with Apex's, whatever its update rule."""

from __future__ import annotations

import pytest
import torch

from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedLARS,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)

ALL = [FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD, FusedLARS, FusedMixedPrecisionLamb]
# Those with a ``set_grad_none`` option (FusedMixedPrecisionLamb's zero_grad takes ``set_to_none`` only).
WITH_SET_GRAD_NONE = [c for c in ALL if c is not FusedMixedPrecisionLamb]


def _bare(cls, params, set_grad_none: bool):
    """An optimizer built as Apex's zero_grad tests build it: ``torch.optim.Optimizer.__init__`` with empty
    defaults, then ``set_grad_none`` set by hand (``add_param_group`` must cope with missing defaults)."""
    opt = cls.__new__(cls)
    torch.optim.Optimizer.__init__(opt, params, {})
    opt.set_grad_none = set_grad_none
    return opt


@pytest.mark.parametrize("cls", WITH_SET_GRAD_NONE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_zero_grad_keeps_the_gradient_tensors_when_set_grad_none_is_false(cls, dtype):
    first = torch.nn.Parameter(torch.ones(2, 3, dtype=dtype))
    second = torch.nn.Parameter(torch.ones(3, dtype=dtype))
    unused = torch.nn.Parameter(torch.ones(1, dtype=dtype))
    first.grad = torch.full_like(first, 3.0, requires_grad=True)
    second.grad = torch.arange(6, dtype=dtype)[::2]  # strided
    before = first.grad, second.grad
    opt = _bare(cls, [{"params": [first]}, {"params": [second, unused]}], False)
    opt.zero_grad()
    assert (first.grad, second.grad) == before
    assert not first.grad.requires_grad
    assert torch.equal(first.grad, torch.zeros_like(first)) and torch.equal(second.grad, torch.zeros_like(second))
    assert unused.grad is None


@pytest.mark.parametrize("cls", WITH_SET_GRAD_NONE)
def test_zero_grad_sets_none_when_set_grad_none(cls):
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones_like(p)
    opt = _bare(cls, [p], True)
    opt.zero_grad()
    assert p.grad is None
    opt.zero_grad()
    assert p.grad is None
