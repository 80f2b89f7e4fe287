"""Dynamic loss scaling: overflow skips exactly one step, the scale halves and doubles, several losses."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from apex import amp
from apex.amp.scaler import LossScaler
from tests.amp._models import OPTIMIZERS, make_optimizer, mlp, mlp_data, skip_if_unavailable


def _state(model, optimizer):
    params = [p.detach().clone() for p in model.parameters()]
    masters = [p.detach().clone() for p in amp.master_params(optimizer)]
    state = {k: {n: t.clone() for n, t in s.items() if torch.is_tensor(t)}
             for k, s in optimizer.state_dict()["state"].items()}
    return params, masters, state


def _equal(a, b) -> bool:
    pa, ma, sa = a
    pb, mb, sb = b
    return (all(torch.equal(x, y) for x, y in zip(pa, pb)) and all(torch.equal(x, y) for x, y in zip(ma, mb))
            and sa.keys() == sb.keys() and all(torch.equal(sa[k][n], sb[k][n]) for k in sa for n in sa[k]))


def _step(model, optimizer, x, y, loss_id=0, inject=None):
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
        scaled.backward()
        if inject is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grads[-1].view(-1)[1] = inject
    optimizer.step()


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("opt_level,half", [("O1", torch.bfloat16), ("O2", torch.bfloat16),
                                            ("O2", torch.float16), ("O1", torch.float16)])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf")], ids=["inf", "nan", "-inf"])
def test_overflow_skips_exactly_that_step(opt_level, half, opt_name, bad, capsys):
    skip_if_unavailable(opt_name)
    model = mlp()
    optimizer = make_optimizer(opt_name, model.parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, half_dtype=half, verbosity=1)
    capsys.readouterr()
    x, y = mlp_data()
    for _ in range(2):  # optimizer state exists before the bad step
        _step(model, optimizer, x, y)
    before = _state(model, optimizer)
    _step(model, optimizer, x, y, inject=bad)
    after = _state(model, optimizer)
    assert _equal(before, after), "a non-finite gradient reached the parameters or the optimizer state"
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 15, "unskipped": 0}
    out = capsys.readouterr().out
    assert out.count("Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0") == 1
    # The next clean step updates again.
    _step(model, optimizer, x, y)
    assert not _equal(after, _state(model, optimizer))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("num_losses", [2, 3])
def test_each_loss_id_has_its_own_scaler(num_losses, capsys):
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", num_losses=num_losses, verbosity=1)
    x, y = mlp_data()
    for loss_id in range(num_losses):
        before = _state(model, optimizer)
        _step(model, optimizer, x, y, loss_id=loss_id, inject=float("inf"))
        assert _equal(before, _state(model, optimizer))
        scales = [amp.state_dict()[f"loss_scaler{i}"]["loss_scale"] for i in range(num_losses)]
        assert scales == [2.0 ** 15] * (loss_id + 1) + [2.0 ** 16] * (num_losses - loss_id - 1)
        assert f"loss scaler {loss_id} reducing loss scale to 32768.0" in capsys.readouterr().out
    _step(model, optimizer, x, y, loss_id=num_losses - 1)
    assert amp.state_dict()[f"loss_scaler{num_losses - 1}"]["unskipped"] == 1
    with pytest.raises(ValueError, match="loss_id"):
        _step(model, optimizer, x, y, loss_id=num_losses)


def test_two_losses_one_step_skips_if_either_overflows():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", num_losses=2, verbosity=0)
    x, y = mlp_data()
    before = _state(model, optimizer)
    optimizer.zero_grad()
    loss0 = F.cross_entropy(model(x), y)
    with amp.scale_loss(loss0, optimizer, loss_id=0) as s:
        s.backward()
    loss1 = model(x).float().pow(2).mean()
    with amp.scale_loss(loss1, optimizer, loss_id=1) as s:
        s.backward()
        next(iter(model.parameters())).grad.view(-1)[0] = float("nan")
    optimizer.step()
    assert _equal(before, _state(model, optimizer))
    sd = amp.state_dict()
    assert sd["loss_scaler0"]["loss_scale"] == 2.0 ** 16 and sd["loss_scaler1"]["loss_scale"] == 2.0 ** 15


def test_scale_doubles_after_2000_clean_steps():
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0, max_loss_scale=2.0 ** 17)
    x = torch.randn(4, 2)
    scales = []
    for _ in range(2001):
        optimizer.zero_grad(set_to_none=False)
        with amp.scale_loss(model(x).float().pow(2).mean(), optimizer) as s:
            s.backward()
        optimizer.step()
        scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
    assert scales[1998] == 2.0 ** 16 and scales[1999] == 2.0 ** 17  # doubled at the 2000th clean step
    assert scales[2000] == 2.0 ** 17


def test_scaler_halving_respects_min_loss_scale():
    s = LossScaler("dynamic", init_scale=8.0, min_loss_scale=2.0)
    for expected in (4.0, 2.0, 2.0):
        s.clear_overflow_state()
        s.unscale([torch.tensor([float("inf")])], [torch.zeros(1)], None)
        assert s.update_scale() is True
        assert s.loss_scale() == expected


def test_scaler_window_and_static_mode():
    s = LossScaler("dynamic", init_scale=4.0, scale_window=3)
    g = [torch.ones(3)]
    for _ in range(7):
        s.clear_overflow_state()
        s.unscale(g, g, None, models_are_masters=True)
        assert s.update_scale() is False
    assert s.loss_scale() == 16.0 and s._unskipped == 1
    capped = LossScaler("dynamic", init_scale=4.0, scale_window=1, max_loss_scale=16.0)
    for _ in range(5):
        capped.clear_overflow_state()
        capped.update_scale()
    assert capped.loss_scale() == 16.0
    static = LossScaler(128.0)
    static.unscale([torch.tensor([float("inf")])], [torch.zeros(1)], None)
    assert static.update_scale() is False and static.loss_scale() == 128.0


def test_unscale_is_one_host_sync_for_many_gradients():
    from apex.testing import count_eager

    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(30)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    loss = model(torch.randn(2, 8)).float().sum()

    def run():
        with amp.scale_loss(loss, optimizer) as s:
            s.backward()

    counts = count_eager(run)
    assert counts["syncs"] == 1, counts


def test_delay_unscale_accumulates_like_one_big_batch():
    x, y = mlp_data(64)
    results = []
    for accumulate in (False, True):
        amp.frontend._reset_casting()
        model = mlp()
        model.eval()  # batch norm statistics would differ between one batch and two halves
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0,
                                          cast_model_type=torch.float32, loss_scale=1024.0)
        optimizer.zero_grad()
        if accumulate:
            for i, half in enumerate((slice(0, 32), slice(32, 64))):
                loss = F.cross_entropy(model(x[half]), y[half], reduction="sum")
                with amp.scale_loss(loss, optimizer, delay_unscale=(i == 0)) as s:
                    s.backward()
        else:
            loss = F.cross_entropy(model(x), y, reduction="sum")
            with amp.scale_loss(loss, optimizer) as s:
                s.backward()
        results.append([p.grad.clone() for p in amp.master_params(optimizer)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_accumulation_without_delay_unscale_adds_unscaled_grads():
    model = mlp()
    model.eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0, half_dtype=torch.bfloat16)
    x, y = mlp_data()
    optimizer.zero_grad()
    grads = []
    for _ in range(2):
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as s:
            s.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for one, two in zip(*grads):
        torch.testing.assert_close(two, 2 * one, rtol=1e-6, atol=1e-7)


def test_gradient_clipping_on_master_grads():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    x, y = mlp_data()
    optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer) as scaled:
        scaled.backward()
    masters = list(amp.master_params(optimizer))
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in masters)
    unclipped = torch.nn.utils.clip_grad_norm_(masters, 1e-3)
    assert 1e-3 < unclipped.item() < 100  # unscaled: a loss scale of 65536 would show here
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in masters]))
    assert total.item() == pytest.approx(1e-3, rel=1e-3)
    before = [m.clone() for m in masters]
    optimizer.step()
    assert all((m - b).abs().max() <= 0.1 * 1e-3 + 1e-6 for m, b in zip(masters, before))


def test_channels_last_gradients(backend_name):
    from tests.amp._models import cnn, cnn_data

    model = cnn().to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    x, y = cnn_data(8)
    _step(model, optimizer, x.to(memory_format=torch.channels_last), y)
    assert any(not p.grad.is_contiguous() for p in model.parameters() if p.grad is not None)
    before = _state(model, optimizer)
    _step(model, optimizer, x, y, inject=float("nan"))
    assert _equal(before, _state(model, optimizer))
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0 ** 15


def test_delay_overflow_check_does_not_skip():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    x, y = mlp_data()
    optimizer.zero_grad()
    with amp.scale_loss(F.cross_entropy(model(x), y), optimizer, delay_overflow_check=True) as s:
        s.backward()
    assert optimizer._amp_stash.skip_pending is None
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2.0 ** 16, "unskipped": 0}
