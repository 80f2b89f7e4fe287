"""amp O2 with ``FusedSGD(materialize_master_grads=False)``: Apex's protocol where the optimizer reads the half
model grads, still scaled, and divides out its ``most_recent_scale``. Several models, several losses with
their own scales, accumulation across backward passes and an inf injected into one backward must give the
parameters of plain fp32 SGD (a skipped iteration contributing nothing), with no fp32 master grads made."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from apex import amp
from apex.amp import _amp_state
from apex.optimizers import FusedSGD

ITERS = 3


class _Toy(nn.Module):
    """One fp32 and one fp16 parameter; with these values every gradient and step is exact in fp16."""

    def __init__(self, unique: int):
        super().__init__()
        self.w0 = nn.Parameter(unique + torch.arange(2, dtype=torch.float32))
        self.w1 = nn.Parameter(1.0 + unique + torch.arange(2, dtype=torch.float16))

    def forward(self, x):
        return (x * self.w0 * self.w1.float()).sum()


def _groups(models):
    return [{"params": list(m.parameters()), "lr": lr} for m, lr in zip(models, (0.25, 0.5, 0.125))]


def _reference(n_models: int, skipped: int | None):
    models = [_Toy(i + 1) for i in range(n_models)]
    for m in models:
        m.float()
    opt = torch.optim.SGD(_groups(models), momentum=0.125)
    x = torch.ones(2)
    for i in range(ITERS):
        if i == skipped:
            continue
        opt.zero_grad()
        for m in models:
            m(x).backward()
        opt.step()
    return [p.detach().clone() for m in models for p in m.parameters()]


@pytest.mark.parametrize("n_models", [2, 3])
@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("inject", [None, ("w1", 0), ("w0", 1), ("w1", 1)], ids=str)
def test_model_grads_protocol_matches_fp32_sgd(n_models, num_losses, inject):
    models = [_Toy(i + 1) for i in range(n_models)]
    opt = FusedSGD(_groups(models), momentum=0.125, materialize_master_grads=False)
    _amp_state.allow_incoming_model_not_fp32 = True
    try:
        models, opt = amp.initialize(models, opt, opt_level="O2", cast_model_type=False, num_losses=num_losses,
                                     verbosity=0)
    finally:
        _amp_state.allow_incoming_model_not_fp32 = False
    scales = [4.0, 16.0][:num_losses]
    for scaler, s in zip(_amp_state.loss_scalers, scales):
        scaler._loss_scale = s
    x = torch.ones(2)
    bad_iter = 1 if inject else None
    # Two losses: the first model's loss, then the sum of the others' (the second backward accumulates).
    for i in range(ITERS):
        opt.zero_grad()
        losses = [models[0](x), sum(m(x) for m in models[1:])]
        for which, loss in enumerate(losses):
            with amp.scale_loss(loss, opt, loss_id=which % num_losses) as scaled:
                scaled.backward()
                if i == bad_iter and which == inject[1]:
                    getattr(models[which], inject[0]).grad[0] = float("inf")
        assert all(m.grad is None for m in amp.master_params(opt) if m.dtype == torch.float32
                   and not any(m is p for mod in models for p in mod.parameters()))
        if i != bad_iter:
            # the accumulated grads are kept at the lower of the scales in use
            assert opt.most_recent_scale == min(s.loss_scale() for s in _amp_state.loss_scalers)
        opt.step()
        assert opt.most_recent_scale == 1.0
    expected = _reference(n_models, bad_iter)
    got = [p for m in models for p in m.parameters()]
    for p, masterp, ref in zip(got, amp.master_params(opt), expected):
        torch.testing.assert_close(p.float(), ref, rtol=0, atol=0)
        torch.testing.assert_close(masterp.to(p.dtype), p, rtol=0, atol=0)
    if inject:
        halved = [s / 2 if k == inject[1] % num_losses else s for k, s in enumerate(scales)]
        assert [s.loss_scale() for s in _amp_state.loss_scalers] == halved


def test_materialized_and_model_grads_protocols_agree():
    """The same run with fp32 master grads (the default) and without gives the same parameters."""
    out = []
    for materialize in (True, False):
        models = [_Toy(1), _Toy(2)]
        opt = FusedSGD(_groups(models), momentum=0.125, materialize_master_grads=materialize)
        _amp_state.allow_incoming_model_not_fp32 = True
        try:
            models, opt = amp.initialize(models, opt, opt_level="O2", cast_model_type=False, verbosity=0)
        finally:
            _amp_state.allow_incoming_model_not_fp32 = False
        for _ in range(ITERS):
            opt.zero_grad()
            for m in models:
                with amp.scale_loss(m(torch.ones(2)), opt) as scaled:
                    scaled.backward()
            opt.step()
        out.append([p.detach().clone() for m in models for p in m.parameters()])
    for a, b in zip(*out):
        assert torch.equal(a, b)
