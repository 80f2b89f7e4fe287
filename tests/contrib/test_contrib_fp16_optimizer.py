"""apex.contrib.optimizers.FP16_Optimizer around the legacy contrib FusedAdam, against a float64 reference of
the same update (loss scale, max_grad_norm clipping, overflow skipping, dynamic scale changes)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from apex.contrib.optimizers import FP16_Optimizer, FusedAdam
from apex.testing import rel_error


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    # ragged shapes, one non-contiguous source
    return [torch.nn.Parameter(torch.randn(s, generator=g).half()) for s in ((7, 5), (13,), (3, 4, 2))]


def _grads(step, params):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in params]


class _Reference:
    """The legacy FusedAdam update in float64 on the fp16 gradients FP16_Optimizer hands it."""

    def __init__(self, params, lr, betas, eps, weight_decay, max_grad_norm):
        self.p = [p.detach().double() for p in params]
        self.m = [torch.zeros_like(p) for p in self.p]
        self.v = [torch.zeros_like(p) for p in self.p]
        self.t = 0
        self.lr, self.betas, self.eps, self.wd, self.max_norm = lr, betas, eps, weight_decay, max_grad_norm

    def step(self, grads16, scale):
        self.t += 1
        g = [x.double() for x in grads16]
        combined = scale
        if self.max_norm > 0:
            norm = math.sqrt(sum(float((x * x).sum()) for x in g))
            clip = (norm / scale + 1e-6) / self.max_norm
            if clip > 1:
                combined = clip * scale
        b1, b2 = self.betas
        step_size = self.lr * math.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)
        for i, gi in enumerate(g):
            gi = gi / combined
            self.m[i] = b1 * self.m[i] + (1 - b1) * gi
            self.v[i] = b2 * self.v[i] + (1 - b2) * gi * gi
            self.p[i] = self.p[i] - step_size * (self.m[i] / (self.v[i].sqrt() + self.eps) + self.wd * self.p[i])


def _check(opt, ref, params):
    masters = [p for g in opt.fp32_groups for p in g]
    err = rel_error(torch.cat([m.reshape(-1).double() for m in masters]),
                    torch.cat([p.reshape(-1) for p in ref.p]))
    assert err <= 2e-6, err
    for m, p in zip(masters, params):  # the model's fp16 weights are the rounded masters
        assert torch.equal(p.detach(), m.half())


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
def test_static_scale_matches_float64_adam(max_grad_norm):
    params = _params()
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01)
    opt = FP16_Optimizer(FusedAdam(params, max_grad_norm=max_grad_norm, **kw), static_loss_scale=128.0,
                         verbose=False)
    ref = _Reference(params, max_grad_norm=max_grad_norm, **kw)
    for step in range(4):
        opt.zero_grad()
        for p, g in zip(params, _grads(step, params)):
            p.grad = (g * opt.cur_scale).half()
        ref.step([p.grad for p in params], opt.cur_scale)
        opt.step()
        _check(opt, ref, params)


def test_dynamic_scale_overflow_skip_and_growth():
    params = _params(1)
    kw = dict(lr=1e-2, betas=(0.8, 0.9), eps=1e-8, weight_decay=0.0)
    opt = FP16_Optimizer(FusedAdam(params, **kw), dynamic_loss_scale=True,
                         dynamic_loss_args={"init_scale": 1024.0, "scale_window": 2}, verbose=False)
    ref = _Reference(params, max_grad_norm=0.0, **kw)
    scales = []
    for step in range(6):
        opt.zero_grad()
        for p, g in zip(params, _grads(step, params)):
            p.grad = (g * opt.cur_scale).half()
        if step in (1, 4):
            params[step % 3].grad.view(-1)[2] = float("inf") if step == 1 else float("nan")
            before = ([p.detach().clone() for p in params], copy.deepcopy(opt.optimizer.state_dict()),
                      [m.clone() for g in opt.fp32_groups for m in g])
            opt.step()
            assert all(torch.equal(a, p) for a, p in zip(before[0], params))
            assert all(torch.equal(a, m) for a, m in zip(before[2], (m for g in opt.fp32_groups for m in g)))
            assert str(before[1]) == str(opt.optimizer.state_dict())
        else:
            ref.step([p.grad for p in params], opt.cur_scale)
            opt.step()
            _check(opt, ref, params)
        scales.append(opt.cur_scale)
    # halved on each overflow, doubled when (iter - last_overflow) is a multiple of the window
    assert scales == [1024.0, 512.0, 512.0, 1024.0, 512.0, 512.0]


def test_backward_scales_the_loss_and_state_dict_round_trip():
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).half()
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2), static_loss_scale=64.0, verbose=False)
    x = torch.randn(5, 6).half()
    opt.zero_grad()
    opt.backward(model(x).float().pow(2).sum())
    scaled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (model(x).float().pow(2).sum() * 64.0).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(scaled, model.parameters()))
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    model2 = copy.deepcopy(model)
    opt2 = FP16_Optimizer(FusedAdam(model2.parameters(), lr=1e-2), static_loss_scale=1.0, verbose=False)
    opt2.load_state_dict(saved)
    assert opt2.cur_scale == 64.0
    for o, m in ((opt, model), (opt2, model2)):
        o.zero_grad()
        o.backward(m(x).float().pow(2).sum())
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt.fp32_groups[0], opt2.fp32_groups[0]))


def test_bad_arguments():
    params = _params()
    with pytest.raises(ValueError, match="dynamic_loss_args"):
        FP16_Optimizer(FusedAdam(params), dynamic_loss_scale=True, dynamic_loss_args={"bogus": 1}, verbose=False)
    with pytest.raises(TypeError, match="init_optimizer"):
        FP16_Optimizer(params, verbose=False)
    opt = FP16_Optimizer(FusedAdam(params), verbose=False)
    bad = dict(opt.state_dict(), fp32_groups=[[torch.zeros(2)]])
    with pytest.raises(ValueError, match="fp32_groups"):
        opt.load_state_dict(bad)


def test_wraps_contrib_fused_sgd():
    from apex.contrib.optimizers import FusedSGD

    params = _params(2)
    masters = [p.detach().double() for p in params]
    buf = None
    opt = FP16_Optimizer(FusedSGD(params, lr=0.1, momentum=0.9), static_loss_scale=32.0, verbose=False)
    for step in range(3):
        opt.zero_grad()
        for p, g in zip(params, _grads(step, params)):
            p.grad = (g * 32.0).half()
        g64 = [p.grad.double() / 32.0 for p in params]
        buf = g64 if buf is None else [0.9 * b + g for b, g in zip(buf, g64)]
        masters = [m - 0.1 * b for m, b in zip(masters, buf)]
        opt.step()
        got = torch.cat([m.reshape(-1).double() for m in opt.fp32_groups[0]])
        assert rel_error(got, torch.cat([m.reshape(-1) for m in masters])) <= 2e-6
        assert all(torch.equal(p.detach(), m.half()) for p, m in zip(params, opt.fp32_groups[0]))
