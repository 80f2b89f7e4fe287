"""A torch.amp.GradScaler step that finds an inf skips FusedSGD/FusedAdagrad/FusedLARS without touching
parameters or state, and the next finite step is unscaled correctly."""

import copy

import pytest
import torch

from apex.optimizers import FusedAdagrad, FusedLARS, FusedSGD
from tests.optimizers._common import assert_state_equal, clone_params, grads_for_step, make_params

OPTIMIZERS = {
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.01),
    "FusedLARS": lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_inf_step_is_skipped_then_training_resumes(backend_name, name):
    params = make_params([(33,), (4097,), (3, 5)], torch.bfloat16)
    opt = OPTIMIZERS[name](params)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    scaler.scale(torch.ones(()))
    for s in range(2):
        for p, g in zip(params, grads_for_step(params, s, scale=2.0 ** 8)):
            p.grad = g
        scaler.step(opt)
        scaler.update()
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    scale = scaler.get_scale()
    for p, g in zip(params, grads_for_step(params, 5, scale=scale)):
        p.grad = g
    params[2].grad[1, 1] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < scale
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert_state_equal(opt.state_dict(), state)
    # The next finite step equals an unscaled step of a twin optimizer.
    twins = clone_params(params)
    ref = OPTIMIZERS[name](twins)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    scale = scaler.get_scale()
    g = grads_for_step(params, 6)
    for p, t, gg in zip(params, twins, g):
        p.grad = (gg.float() * scale).to(p.dtype)
        t.grad = gg.clone()
    scaler.step(opt)
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins))
