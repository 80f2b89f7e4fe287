"""apex.fp16_utils: conversion helpers, master-parameter helpers, legacy loss scalers, FP16_Optimizer."""

import io
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from apex.fp16_utils import (
    BN_convert_float,
    DynamicLossScaler,
    FP16_Optimizer,
    FP16Model,
    LossScaler,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore", DeprecationWarning)
    yield
    torch.set_num_threads(threads)


def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.BatchNorm1d(16, affine=False),
                         nn.Linear(16, 3))


def test_convert_network_keeps_affine_batchnorm_fp32():
    m = convert_network(net(), torch.float16)
    assert m[0].weight.dtype == torch.float16 and m[4].bias.dtype == torch.float16
    assert m[1].weight.dtype == torch.float32 and m[1].running_mean.dtype == torch.float32
    assert m[3].running_mean.dtype == torch.float16  # not affine: converted like Apex
    assert m[1].num_batches_tracked.dtype == torch.int64


def test_convert_module_is_not_recursive_and_converts_grads():
    m = net()
    m[0].weight.grad = torch.ones_like(m[0].weight)
    convert_module(m[0], torch.bfloat16)
    assert m[0].weight.dtype == torch.bfloat16 and m[0].weight.grad.dtype == torch.bfloat16
    convert_module(m, torch.bfloat16)
    assert m[4].weight.dtype == torch.float32


def test_network_to_half_and_bn_convert_float():
    m = network_to_half(net())
    assert isinstance(m[0], tofp16) and m[1][0].weight.dtype == torch.float16
    assert m[1][1].weight.dtype == torch.float32
    assert tofp16()(torch.ones(2)).dtype == torch.float16
    h = net().half()
    BN_convert_float(h)
    assert h[1].weight.dtype == torch.float32 and h[0].weight.dtype == torch.float16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_model(dtype):
    m = FP16Model(net(), dtype=dtype) if dtype != torch.float16 else FP16Model(net())
    out = m(torch.randn(4, 8))
    assert out.dtype == dtype and m.network[1].weight.dtype == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        FP16Model(net(), dtype=torch.float64)


@pytest.mark.parametrize("flat", [False, True])
def test_master_param_helpers_round_trip(flat):
    model = net().half()
    model_params, master_params = prep_param_lists(model, flat_master=flat)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in master_params)
    assert len(master_params) == (1 if flat else len(model_params))
    if flat:
        assert master_params[0].grad is not None
        assert master_params[0].numel() == sum(p.numel() for p in model_params)
    F.mse_loss(model(torch.randn(4, 8).half()).float(), torch.zeros(4, 3)).backward()
    model_grads_to_master_grads(model_params, master_params, flat_master=flat)
    grads = torch.cat([p.grad.float().reshape(-1) for p in model_params])
    mgrads = torch.cat([p.grad.reshape(-1) for p in master_params])
    assert torch.equal(grads, mgrads)
    with torch.no_grad():
        for m in master_params:
            m.add_(0.5)
    master_params_to_model_params(model_params, master_params, flat_master=flat)
    values = torch.cat([p.float().reshape(-1) for p in model_params])
    masters = torch.cat([p.detach().reshape(-1) for p in master_params])
    assert torch.equal(values, masters.half().float())


def test_prep_param_lists_flat_master_of_a_mixed_model():
    """Apex flattens with ``_flatten_dense_tensors`` (torch.cat), which promotes mixed fp16/fp32
    parameters: one fp32 master, and the helpers round-trip each parameter in its own dtype."""
    model = net()
    model[0].half()
    model_params, (master,) = prep_param_lists(model, flat_master=True)
    assert {p.dtype for p in model_params} == {torch.float16, torch.float32}
    assert master.dtype == torch.float32 and master.numel() == sum(p.numel() for p in model_params)
    assert torch.equal(master.detach(), torch.cat([p.detach().float().reshape(-1) for p in model_params]))
    for p in model_params:
        p.grad = torch.randn_like(p)
    model_grads_to_master_grads(model_params, [master], flat_master=True)
    assert torch.equal(master.grad, torch.cat([p.grad.float().reshape(-1) for p in model_params]))
    with torch.no_grad():
        master.add_(0.25)
    master_params_to_model_params(model_params, [master], flat_master=True)
    at = 0
    for p in model_params:
        n = p.numel()
        assert p.dtype in (torch.float16, torch.float32)
        assert torch.equal(p.detach(), master.detach()[at:at + n].view_as(p).to(p.dtype))
        at += n


def test_small_helpers():
    assert to_python_float(torch.tensor(2.5)) == 2.5 and to_python_float([3.0]) == 3.0
    assert clip_grad_norm is torch.nn.utils.clip_grad_norm_


def test_dynamic_loss_scaler_semantics():
    s = DynamicLossScaler()
    assert s.loss_scale == 2.0 ** 32 and s.scale_factor == 2.0 and s.scale_window == 1000
    s = DynamicLossScaler(init_scale=4.0, scale_window=3)
    trace = []
    for overflow in [False, False, False, True, False, False, False, True, True, True, True]:
        s.update_scale(overflow)
        trace.append(s.loss_scale)
    assert trace == [4.0, 4.0, 8.0, 4.0, 4.0, 4.0, 8.0, 4.0, 2.0, 1.0, 1]  # never below 1
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert s.has_overflow([p]) and DynamicLossScaler._has_inf_or_nan(torch.tensor([float("inf")]))
    h = nn.Parameter(torch.ones(3).half())
    h.grad = torch.tensor([6e4, -6e4, 1.0]).half()  # large but finite: no false alarm
    assert not s.has_overflow([h])
    static = LossScaler(128.0)
    assert static.loss_scale == 128.0 and not static.has_overflow([p])


def _fp16_setup(dynamic, seed=0, **kw):
    model = net(seed).half()
    BN_convert_float(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, FP16_Optimizer(opt, static_loss_scale=128.0, dynamic_loss_scale=dynamic, verbose=False, **kw)


def _fp16_step(model, optimizer, i, inject=None):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x.half()).float(), y)
    optimizer.backward(loss, update_master_grads=inject is None)
    if inject is not None:
        model[0].weight.grad.view(-1)[0] = inject
        optimizer.update_master_grads()
    optimizer.step()
    return loss


def test_fp16_optimizer_matches_manual_master_weights():
    model, optimizer = _fp16_setup(dynamic=False)
    ref_model = net(0).half()
    BN_convert_float(ref_model)
    model_params, masters = prep_param_lists(ref_model)
    ref_opt = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    for i in range(3):
        _fp16_step(model, optimizer, i)
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
        ref_opt.zero_grad()
        for p in model_params:
            p.grad = None
        (F.cross_entropy(ref_model(x.half()).float(), y) * 128.0).backward()
        model_grads_to_master_grads(model_params, masters)
        for m in masters:
            m.grad.mul_(1.0 / 128.0)
        ref_opt.step()
        master_params_to_model_params(model_params, masters)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
    assert optimizer.loss_scale == 128.0


def test_fp16_optimizer_dynamic_overflow_skips(capsys):
    model, optimizer = _fp16_setup(dynamic=True, dynamic_loss_args={"init_scale": 2.0 ** 10})
    _fp16_step(model, optimizer, 0)
    before = [p.clone() for p in model.parameters()]
    state = {k: v["momentum_buffer"].clone() for k, v in optimizer.state.items()}
    _fp16_step(model, optimizer, 1, inject=float("inf"))
    assert optimizer.overflow and optimizer.loss_scale == 2.0 ** 9
    assert "Gradient overflow.  Skipping step, reducing loss scale to 512.0" in capsys.readouterr().out
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(torch.equal(state[k], v["momentum_buffer"]) for k, v in optimizer.state.items())
    assert optimizer.clip_master_grads(1.0) == -1
    assert optimizer.inspect_master_grad_data() is None
    _fp16_step(model, optimizer, 2)
    assert not optimizer.overflow
    norm = optimizer.clip_master_grads(1e-3)
    assert norm > 1e-3
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for g in
                                                  optimizer.param_groups for p in g["params"]]))
    assert total.item() == pytest.approx(1e-3, rel=1e-3)


def test_fp16_optimizer_state_dict_resumes_bit_for_bit():
    model, optimizer = _fp16_setup(dynamic=True)
    for i in range(6):
        _fp16_step(model, optimizer, i, inject=float("nan") if i == 2 else None)
    expected = [p.clone() for p in model.parameters()]

    model, optimizer = _fp16_setup(dynamic=True)
    for i in range(3):
        _fp16_step(model, optimizer, i, inject=float("nan") if i == 2 else None)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buf)
    model, optimizer = _fp16_setup(dynamic=True, seed=5)
    buf.seek(0)
    ckpt = torch.load(buf)  # weights_only: the checkpoint holds only tensors and plain values
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    assert optimizer.loss_scale == 2.0 ** 15
    for i in range(3, 6):
        _fp16_step(model, optimizer, i)
    assert all(torch.equal(a, b) for a, b in zip(expected, model.parameters()))


def test_fp16_optimizer_closure_and_properties():
    model, optimizer = _fp16_setup(dynamic=False)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x.half()).float(), y)
        optimizer.backward(loss)
        return loss

    before = model[0].weight.clone()
    loss = optimizer.step(closure)
    assert torch.isfinite(loss) and not torch.equal(before, model[0].weight)
    optimizer.param_groups[0]["lr"] = 0.01
    assert optimizer.optimizer.param_groups[0]["lr"] == 0.01
    assert optimizer.state is optimizer.optimizer.state
    optimizer.loss_scale = 64.0
    assert optimizer.loss_scaler.loss_scale() == 64.0
    optimizer.zero_grad(set_grads_to_None=True)
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(RuntimeError, match="state_dict"):
        import pickle

        pickle.dumps(optimizer)
    with pytest.raises(TypeError, match="init_optimizer"):
        FP16_Optimizer(model)
