"""Apex's README checkpoint recipe resumes bit for bit against an uninterrupted run."""

import io

import pytest
import torch
import torch.nn.functional as F

from apex import amp
from tests.amp._models import OPTIMIZERS, make_optimizer, mlp, skip_if_unavailable

STEPS = 6      # per half of the run
OVERFLOW_AT = 2  # one injected overflow in each half, so the scaler's state matters


def _batch(i):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(32, 16, generator=g)
    return x, (x[:, :4] * 3).argmax(1)


def _train(model, optimizer, start, steps):
    for i in range(start, start + steps):
        x, y = _batch(i)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            if i % STEPS == OVERFLOW_AT:
                next(iter(model.parameters())).grad.view(-1)[0] = float("inf")
        optimizer.step()


def _setup(opt_level, half, opt_name, seed):
    model = mlp(seed)
    optimizer = make_optimizer(opt_name, model.parameters())
    kw = {"half_dtype": half} if opt_level == "O1" else {"cast_model_type": half}
    return amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0, **kw)


def _snapshot(model, optimizer):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {k: {n: (t.clone() if torch.is_tensor(t) else t) for n, t in s.items()}
             for k, s in optimizer.state_dict()["state"].items()},
            dict(amp.state_dict()))


def _assert_identical(a, b):
    (ma, oa, sa), (mb, ob, sb) = a, b
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k].dtype == mb[k].dtype and torch.equal(ma[k], mb[k]), f"model {k} differs"
    assert oa.keys() == ob.keys()
    for k in oa:
        for n in oa[k]:
            x, y = oa[k][n], ob[k][n]
            assert (torch.equal(x, y) if torch.is_tensor(x) else x == y), f"optimizer state {k}.{n} differs"
    assert sa == sb


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_checkpoint_resumes_bit_for_bit(opt_level, half, opt_name):
    skip_if_unavailable(opt_name)
    # Uninterrupted run.
    model, optimizer = _setup(opt_level, half, opt_name, seed=0)
    _train(model, optimizer, 0, 2 * STEPS)
    expected = _snapshot(model, optimizer)
    assert expected[2]["loss_scaler0"]["loss_scale"] == 2.0 ** 14  # two overflows halved it twice

    # Interrupted run: the README recipe, verbatim apart from the buffer.
    model, optimizer = _setup(opt_level, half, opt_name, seed=0)
    _train(model, optimizer, 0, STEPS)
    checkpoint = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}
    buf = io.BytesIO()
    torch.save(checkpoint, buf)
    del model, optimizer, checkpoint

    model, optimizer = _setup(opt_level, half, opt_name, seed=123)  # different init: all must come from disk
    buf.seek(0)
    checkpoint = torch.load(buf)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    amp.load_state_dict(checkpoint["amp"])
    _train(model, optimizer, STEPS, STEPS)
    _assert_identical(_snapshot(model, optimizer), expected)


def test_o2_model_state_dict_is_fp32_masters():
    model, optimizer = _setup("O2", torch.bfloat16, "SGD", seed=0)
    _train(model, optimizer, 0, 2)
    sd = model.state_dict()
    masters = list(amp.master_params(optimizer))
    weights = [v for k, v in sd.items() if k.endswith(("weight", "bias"))]
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    assert len(weights) == len(masters)
    assert all(torch.equal(w, m) for w, m in zip(weights, masters))
    # The half model parameters are the masters rounded once.
    halves = [p for p in model.parameters() if p.dtype == torch.bfloat16]
    assert halves and all(torch.equal(p, m.to(p.dtype)) for p, m in zip(model.parameters(), masters)
                          if p.dtype == torch.bfloat16)


def test_amp_state_dict_layout_and_load():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O1", num_losses=3, verbosity=0)
    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert sd["loss_scaler1"] == {"loss_scale": 65536.0, "unskipped": 0}
    amp.load_state_dict({"loss_scaler0": {"loss_scale": 8.0, "unskipped": 5},
                         "loss_scaler1": {"loss_scale": 16.0, "unskipped": 6},
                         "loss_scaler2": {"loss_scale": 32.0, "unskipped": 7}})
    assert amp.state_dict()["loss_scaler2"] == {"loss_scale": 32.0, "unskipped": 7}
    assert amp._amp_state.loss_scalers[0].loss_scale() == 8.0


def test_load_state_dict_with_foreign_keys_lists_them_and_changes_nothing():
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    before = dict(amp.state_dict())
    bad = {"loss_scaler0": {"loss_scale": 2.0, "unskipped": 1}, "optimizer": {}, "epoch": 3}
    with pytest.raises(RuntimeError, match='Unexpected key.*"optimizer", "epoch"'):
        amp.load_state_dict(bad)
    assert dict(amp.state_dict()) == before


@pytest.mark.parametrize("opt_level,extra", [("O3", {}), ("O2", {"master_weights": False}),
                                             ("O3", {"keep_batchnorm_fp32": True})])
def test_model_state_dict_is_fp32_whenever_the_model_was_cast(opt_level, extra):
    """Apex's O2StateDictHook: a cast model saves fp32 values, masters or not."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, cast_model_type=torch.float16, verbosity=0,
                                **extra)
    assert any(p.dtype == torch.float16 for p in model.parameters())
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    for name, p in model.named_parameters():
        assert torch.equal(sd[name], p.detach().float())
