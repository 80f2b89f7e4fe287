"""FusedAdagrad against a float64 reference, torch.optim.Adagrad, checkpoints, launch counts, bad input."""

from __future__ import annotations

import copy

import pytest
import torch

import apex
from apex.optimizers import FusedAdagrad
from apex.testing import TritonTrace, rel_error
from tests.optimizers._common import (
    PRECISIONS,
    SHAPES_TRITON,
    assert_state_equal,
    clone_params,
    grads_for_step,
    make_params,
    set_grads,
    shapes_for,
    snapshot,
)

STEPS = 10


def reference_adagrad(params, grads_per_step, *, lr, eps, weight_decay, w_mode, store_dtype=None):
    out = []
    for i, p0 in enumerate(params):
        p = p0.detach().double().clone()
        h = torch.zeros_like(p)
        for grads in grads_per_step:
            g = grads[i].double()
            if not w_mode:
                g = g + weight_decay * p
            h = h + g * g
            if store_dtype is not None:
                h = h.to(store_dtype).double()
            u = g / (h.sqrt() + eps)
            if w_mode:
                u = u + weight_decay * p
            p = p - lr * u
            if store_dtype is not None:
                p = p.to(store_dtype).double()
        out.append(p)
    return out


OPTIONS = [dict(), dict(weight_decay=0.05), dict(weight_decay=0.05, adagrad_w_mode=True),
           dict(eps=1e-3, adagrad_w_mode=True)]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("dtype,tol", PRECISIONS, ids=str)
def test_matches_float64_reference(backend_name, opts, dtype, tol):
    if backend_name == "triton" and dtype != torch.float32 and opts is not OPTIONS[2]:
        pytest.skip("interpreted Triton: reduced precision checked with one option set")
    shapes = shapes_for(backend_name) if dtype == torch.float32 else SHAPES_TRITON
    params = make_params(shapes, dtype)
    opt = FusedAdagrad(params, lr=0.05, **opts)
    grads = [grads_for_step(params, s) for s in range(STEPS)]
    ref = reference_adagrad(params, grads, lr=0.05, eps=opts.get("eps", 1e-10),
                            weight_decay=opts.get("weight_decay", 0.0), w_mode=opts.get("adagrad_w_mode", False),
                            store_dtype=None if dtype == torch.float32 else dtype)
    for s in range(STEPS):
        set_grads(params, grads[s])
        opt.step()
    for p, r in zip(params, ref):
        assert p.dtype == dtype and opt.state[p]["sum"].dtype == dtype
        assert rel_error(p, r) <= tol, (p.shape, rel_error(p, r))
        assert float(opt.state[p]["step"]) == STEPS


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_equals_torch_optim_adagrad_and_checkpoints_move(weight_decay):
    params = make_params(shapes_for("torch"))
    twins = clone_params(params)
    ours = FusedAdagrad(params, lr=0.05, weight_decay=weight_decay)
    ref = torch.optim.Adagrad(twins, lr=0.05, weight_decay=weight_decay)
    for s in range(STEPS):
        g = grads_for_step(params, s)
        set_grads(params, g)
        set_grads(twins, g)
        ours.step()
        ref.step()
        for a, b in zip(params, twins):
            assert rel_error(a, b) <= 1e-6
    back = clone_params(twins)
    ours2 = FusedAdagrad(back, lr=0.05, weight_decay=weight_decay)
    ours2.load_state_dict(copy.deepcopy(ref.state_dict()))
    ref2 = torch.optim.Adagrad(clone_params(params), lr=0.05, weight_decay=weight_decay)
    ref2.load_state_dict(copy.deepcopy(ours.state_dict()))
    g = grads_for_step(params, 99)
    set_grads(back, g)
    set_grads(twins, g)
    ours2.step()
    ref.step()
    for a, b in zip(back, twins):
        assert rel_error(a, b) <= 1e-6


def test_state_dict_round_trip_resumes_bit_for_bit(backend_name):
    params = make_params(SHAPES_TRITON[:3], torch.float16)
    opt = FusedAdagrad(params, lr=0.05, weight_decay=0.01, adagrad_w_mode=True)
    for s in range(3):
        set_grads(params, grads_for_step(params, s))
        opt.step()
    mid_p, mid_state = snapshot(opt, params)
    for s in range(3, 6):
        set_grads(params, grads_for_step(params, s))
        opt.step()
    resumed = [torch.nn.Parameter(p.clone()) for p in mid_p]
    opt2 = FusedAdagrad(resumed, lr=0.05, weight_decay=0.01, adagrad_w_mode=True)
    opt2.load_state_dict(mid_state)
    for s in range(3, 6):
        set_grads(resumed, grads_for_step(resumed, s))
        opt2.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    assert_state_equal(opt.state_dict(), opt2.state_dict())


def test_one_launch_per_dtype_group(triton_device):
    pytest.importorskip("triton")
    params = make_params(SHAPES_TRITON) + make_params(SHAPES_TRITON, torch.float16, seed=3)
    opt = FusedAdagrad(params)
    set_grads(params, grads_for_step(params, 0))
    opt.step()
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        for p in params:
            tr.watch(p, p.grad, opt.state[p]["sum"])
        opt.step()
    assert tr.launches == 2


def test_defaults_set_grad_none_and_closure():
    import inspect

    sig = inspect.signature(FusedAdagrad.__init__)
    assert {k: v.default for k, v in list(sig.parameters.items())[2:]} == dict(
        lr=1e-2, eps=1e-10, weight_decay=0.0, set_grad_none=True, adagrad_w_mode=False)
    p = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdagrad([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    first = opt.step(closure)
    for _ in range(10):
        last = opt.step(closure)
    assert last < first
    opt.zero_grad()
    assert p.grad is None


@pytest.mark.parametrize("kwargs,word", [(dict(lr=-1.0), "lr"), (dict(eps=-1e-10), "eps"),
                                         (dict(weight_decay=-0.1), "weight_decay")])
def test_bad_hyperparameters(kwargs, word):
    with pytest.raises(ValueError, match=word):
        FusedAdagrad([torch.nn.Parameter(torch.randn(2))], **kwargs)


def test_bad_grads_raise_and_change_nothing():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    opt = FusedAdagrad([a, b])
    a.grad = torch.ones(3)
    b.grad = torch.ones(4).to_sparse()
    a0 = a.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    b.grad = torch.ones(4)
    b.grad.data = torch.ones(5)
    with pytest.raises(RuntimeError, match="shape"):
        opt.step()
    assert torch.equal(a, a0) and len(opt.state) == 0
