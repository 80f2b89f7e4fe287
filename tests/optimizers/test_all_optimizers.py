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


def _make(cls, params):
    if cls is FusedMixedPrecisionLamb:
        return cls(params, lr=1e-2, reduced_precision_dtype=torch.float16)
    if cls is FusedAdam:
        return cls(params, lr=1e-2, master_weights=True)
    return cls(params, lr=1e-2)


@pytest.mark.parametrize("copy_with", ["deepcopy", "pickle"])
@pytest.mark.parametrize("cls", ALL)
def test_a_copied_optimizer_keeps_its_attributes_and_trains_on_identically(cls, copy_with):
    """``torch.optim.Optimizer.__getstate__`` alone would drop every attribute set by the constructor."""
    import copy
    import pickle

    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16 if cls in (FusedMixedPrecisionLamb, FusedAdam) else torch.float32
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in (3, 4097)]
    opt = _make(cls, params)
    grads = [[torch.randn(p.shape, generator=gen).to(dtype) for p in params] for _ in range(3)]
    for p, g in zip(params, grads[0]):
        p.grad = g.clone()
    opt.step()
    twin = copy.deepcopy(opt) if copy_with == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = twin.param_groups[0]["params"]
    assert twin_params[0] is not params[0]
    for key in ("set_grad_none", "adam_w_mode", "capturable", "master_weights", "use_nvlamb",
                "reduced_precision_dtype", "_dummy_overflow_buf", "param_groups_master"):
        assert hasattr(twin, key) == hasattr(opt, key), key
    for step_grads in grads[1:]:
        for ps in (params, twin_params):
            for p, g in zip(ps, step_grads):
                p.grad = g.clone()
        opt.step()
        twin.step()
    for p, q in zip(params, twin_params):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedSGD])
def test_an_optimizer_prepared_by_amp_still_pickles(cls):
    """amp.initialize binds methods to the optimizer object, which a pickle cannot restore: the copy is
    the optimizer as constructed (as torch.optim's own pickling gives), and it steps."""
    import pickle

    from apex import amp

    model = torch.nn.Linear(4, 4)
    opt = _make(cls, model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    twin = pickle.loads(pickle.dumps(opt))
    assert type(twin) is cls and not hasattr(twin, "_amp_stash")
    p = twin.param_groups[0]["params"][0]
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    twin.step()
    assert not torch.equal(p.detach(), before)
