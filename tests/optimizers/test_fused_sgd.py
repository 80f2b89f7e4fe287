"""FusedSGD against a float64 reference of torch.optim.SGD's rule, torch.optim.SGD itself, checkpoints,
amp's master-weight protocol, launch counts and bad input."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import apex
from apex.optimizers import FusedSGD
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


def reference_sgd(params, grads_per_step, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  nesterov=False, wd_after_momentum=False, store_dtype=None):
    out = []
    for i, p0 in enumerate(params):
        p = p0.detach().double().clone()
        buf = None
        for grads in grads_per_step:
            g = grads[i].double()
            if weight_decay and not wd_after_momentum:
                g = g + weight_decay * p
            if momentum:
                buf = g.clone() if buf is None else momentum * buf + (1 - dampening) * g
                if store_dtype is not None:
                    buf = buf.to(store_dtype).double()
                g = g + momentum * buf if nesterov else buf
            if weight_decay and wd_after_momentum:
                g = g + weight_decay * p
            p = p - lr * g
            if store_dtype is not None:
                p = p.to(store_dtype).double()
        out.append(p)
    return out


OPTIONS = [
    dict(),
    dict(momentum=0.9),
    dict(momentum=0.9, nesterov=True, weight_decay=0.05),
    dict(momentum=0.8, dampening=0.3, weight_decay=0.05, wd_after_momentum=True),
    dict(weight_decay=0.05),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("dtype,tol", PRECISIONS, ids=str)
def test_matches_float64_reference(backend_name, opts, dtype, tol):
    if backend_name == "triton" and dtype != torch.float32 and opts is not OPTIONS[3]:
        pytest.skip("interpreted Triton: reduced precision checked with one option set")
    shapes = shapes_for(backend_name) if dtype == torch.float32 else SHAPES_TRITON
    params = make_params(shapes, dtype)
    opt_kw = {k: v for k, v in opts.items() if k != "wd_after_momentum"}
    opt = FusedSGD(params, lr=0.05, wd_after_momentum=opts.get("wd_after_momentum", False), **opt_kw)
    grads = [grads_for_step(params, s) for s in range(STEPS)]
    ref = reference_sgd(params, grads, lr=0.05, **opts, store_dtype=None if dtype == torch.float32 else dtype)
    for s in range(STEPS):
        set_grads(params, grads[s])
        opt.step()
    for p, r in zip(params, ref):
        assert p.dtype == dtype
        assert rel_error(p, r) <= tol, (p.shape, rel_error(p, r))
        if opts.get("momentum"):
            assert opt.state[p]["momentum_buffer"].dtype == dtype


@pytest.mark.parametrize("opts", OPTIONS[:4], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_equals_torch_optim_sgd(opts):
    if opts.get("wd_after_momentum"):
        pytest.skip("torch.optim.SGD has no wd_after_momentum")
    params = make_params(shapes_for("torch"))
    twins = clone_params(params)
    ours = FusedSGD(params, lr=0.05, **opts)
    ref = torch.optim.SGD(twins, lr=0.05, **opts)
    for s in range(STEPS):
        g = grads_for_step(params, s)
        set_grads(params, g)
        set_grads(twins, g)
        ours.step()
        ref.step()
        for a, b in zip(params, twins):
            assert rel_error(a, b) <= 1e-6
    ref2 = torch.optim.SGD(clone_params(params), lr=0.05, **opts)
    ref2.load_state_dict(copy.deepcopy(ours.state_dict()))


def test_state_dict_round_trip_resumes_bit_for_bit(backend_name):
    params = make_params(SHAPES_TRITON[:3])
    opt = FusedSGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    for s in range(3):
        set_grads(params, grads_for_step(params, s))
        opt.step()
    mid_p, mid_state = snapshot(opt, params)
    for s in range(3, 6):
        set_grads(params, grads_for_step(params, s))
        opt.step()
    resumed = [torch.nn.Parameter(p.clone()) for p in mid_p]
    opt2 = FusedSGD(resumed, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    opt2.load_state_dict(mid_state)
    for s in range(3, 6):
        set_grads(resumed, grads_for_step(resumed, s))
        opt2.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    assert_state_equal(opt.state_dict(), opt2.state_dict())


def test_amp_master_weight_protocol(backend_name):
    """Apex amp O2: fp32 masters updated from fp16 model grads (or materialized fp32 grads), and the fp16
    model params receive the result in the same pass; amp's loss scale is divided out inside."""
    model = make_params([(33,), (4097,)], torch.float16)
    masters = [torch.nn.Parameter(p.detach().float()) for p in model]
    fp32_params = make_params([(9,)], seed=5)
    for materialize in (True, False):
        opt = FusedSGD(masters + fp32_params, lr=0.1, momentum=0.9, materialize_master_grads=materialize)
        opt._amp_stash = types.SimpleNamespace(fp16_groups=[model], fp32_from_fp16_groups=[masters],
                                               fp32_from_fp32_groups=[fp32_params])
        g16 = grads_for_step(model, 0)
        for c, m, g in zip(model, masters, g16):
            c.grad = (g.float() * 8).half()
            m.grad = c.grad.float() if materialize else None
        fp32_params[0].grad = torch.ones(9) * 8
        before = [m.detach().clone() for m in masters]
        f0 = fp32_params[0].detach().clone()
        opt.most_recent_scale = 8.0
        opt.step()
        for c, m, b, g in zip(model, masters, before, g16):
            assert torch.allclose(m, b - 0.1 * g.float(), rtol=1e-6, atol=1e-6)
            assert torch.equal(c, m.half())
        assert torch.allclose(fp32_params[0], f0 - 0.1, atol=1e-6)
        assert opt.most_recent_scale == 1.0


def test_one_launch_per_dtype_group(triton_device):
    pytest.importorskip("triton")
    params = make_params(SHAPES_TRITON) + make_params(SHAPES_TRITON, torch.bfloat16, seed=3)
    opt = FusedSGD(params, lr=0.1, momentum=0.9)
    set_grads(params, grads_for_step(params, 0))
    opt.step()
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        for p in params:
            tr.watch(p, p.grad, opt.state[p]["momentum_buffer"])
        opt.step()
    assert tr.launches == 2


def test_set_grad_none_default_false_and_params_without_grads():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    opt = FusedSGD([a, b], lr=0.1, momentum=0.9)
    a.grad = torch.ones(3)
    b0 = b.detach().clone()
    opt.step()
    assert torch.equal(b, b0) and len(opt.state[b]) == 0
    opt.zero_grad()
    assert torch.equal(a.grad, torch.zeros(3))
    opt2 = FusedSGD([a], lr=0.1, set_grad_none=True)
    opt2.zero_grad()
    assert a.grad is None


@pytest.mark.parametrize("kwargs,word", [
    (dict(lr=-0.1), "lr"), (dict(lr=0.1, momentum=-0.5), "momentum"),
    (dict(lr=0.1, weight_decay=-1.0), "weight_decay"), (dict(lr=0.1, nesterov=True), "Nesterov"),
    (dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True), "Nesterov"),
])
def test_bad_hyperparameters(kwargs, word):
    with pytest.raises(ValueError, match=word):
        FusedSGD([torch.nn.Parameter(torch.randn(2))], **kwargs)


def test_sparse_and_mismatched_grads_raise_and_change_nothing():
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(4))
    opt = FusedSGD([a, b], lr=0.1, momentum=0.9)
    a.grad = torch.ones(3)
    b.grad = torch.ones(4).to_sparse()
    a0 = a.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    b.grad = torch.ones(4)
    b.grad.data = torch.ones(4, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="dtype"):
        opt.step()
    assert torch.equal(a, a0) and len(opt.state) == 0


REDUCED_OPTIONS = [dict(momentum=0.125), dict(momentum=0.9, nesterov=True, weight_decay=0.05),
                   dict(momentum=0.8, dampening=0.3, weight_decay=0.05)]


def rounded_like_torch(params, grads_per_step, *, lr, momentum, dampening=0.0, weight_decay=0.0,
                       nesterov=False):
    """torch.optim.SGD's sequence of operations on fp16/bf16 tensors, each result rounded to the dtype
    (float64 arithmetic, Python-float scalars as CUDA's opmath uses them)."""
    out = []
    for i, p0 in enumerate(params):
        def rnd(x, dt=p0.dtype):
            return x.to(dt).double()

        p, buf = p0.detach().double(), None
        for grads in grads_per_step:
            g = grads[i].double()
            if weight_decay:
                g = rnd(g + weight_decay * p)
            buf = g.clone() if buf is None else rnd(rnd(momentum * buf) + (1 - dampening) * g)
            g = rnd(g + momentum * buf) if nesterov else buf
            p = rnd(p - lr * g)
        out.append((p, buf))
    return out


@pytest.mark.parametrize("opts", REDUCED_OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reduced_precision_params_follow_torch_optim_sgd(backend_name, opts, dtype):
    """The rounding rule (issue 22): fp16/bf16 params without fp32 masters keep an fp16/bf16 momentum buffer
    and, like torch.optim.SGD, step with the *stored* (rounded) buffer, not with Apex CUDA's unrounded fp32
    one; every operation of torch's rule rounds its result. The PyTorch path runs torch's own operations, so
    it equals torch.optim.SGD on the same device bit for bit (on the CPU, torch rounds an ``alpha`` to
    fp16/bf16 first); the Triton path computes each of them in fp32 with fp32 scalars (CUDA's opmath) and
    rounds: it must equal the rounded reference except for rare double-rounding ties."""
    shapes = SHAPES_TRITON if backend_name == "triton" else [(278011,), (5, 7, 3)]
    gen = torch.Generator().manual_seed(9876)
    params = [torch.nn.Parameter(torch.rand(*s, generator=gen).to(dtype)) for s in shapes]
    twins = clone_params(params)
    ours, ref = FusedSGD(params, lr=0.25, **opts), torch.optim.SGD(twins, lr=0.25, **opts)
    grads = [[torch.rand(p.shape, generator=gen).to(dtype) for p in params] for _ in range(7)]
    expected = rounded_like_torch(params, grads, lr=0.25, **opts)
    for g in grads:
        set_grads(params, g)
        set_grads(twins, [x.clone() for x in g])
        ours.step()
        ref.step()
    for a, b, (p_ref, buf_ref) in zip(params, twins, expected):
        buf = ours.state[a]["momentum_buffer"]
        assert a.dtype == dtype and buf.dtype == dtype
        if backend_name == "torch":
            assert torch.equal(a, b)
            assert torch.equal(buf, ref.state[b]["momentum_buffer"])
        else:
            for x, r in ((a, p_ref), (buf, buf_ref)):
                ulp = torch.finfo(dtype).eps * r.abs().clamp_min(2.0**-14)
                assert ((x.double() - r).abs() <= ulp).all()
                assert (x.double() != r).double().mean() <= 0.01
