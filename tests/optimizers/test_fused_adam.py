"""FusedAdam against a float64 one-parameter-at-a-time reference, torch.optim.AdamW/Adam, checkpoints,
mixed-precision skipping, launch counts and bad input."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import apex
from apex.optimizers import FusedAdam
from apex.testing import TritonTrace, rel_error
from tests.optimizers._common import (
    assert_state_equal,
    clone_params,
    grads_for_step,
    make_params,
    set_grads,
    shapes_for,
    snapshot,
)

STEPS = 10


def reference_adam(params, grads_per_step, *, lr, betas, eps, weight_decay, adam_w_mode, bias_correction,
                   store_dtype=None):
    """Apex's documented rule in float64, one parameter at a time. ``store_dtype``: round the parameter
    to this dtype after every step (a parameter stored in fp16/bf16 without master weights)."""
    b1, b2 = betas
    out = []
    for i, p0 in enumerate(params):
        p = p0.detach().double().clone()
        m = torch.zeros_like(p)
        v = torch.zeros_like(p)
        for t, grads in enumerate(grads_per_step, start=1):
            g = grads[i].double()
            if not adam_w_mode:
                g = g + weight_decay * p
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            bc1 = 1 - b1 ** t if bias_correction else 1.0
            bc2 = 1 - b2 ** t if bias_correction else 1.0
            u = (m / bc1) / ((v / bc2).sqrt() + eps)
            if adam_w_mode:
                u = u + weight_decay * p
            p = p - lr * u
            if store_dtype is not None:
                p = p.to(store_dtype).double()
        out.append((p, m, v))
    return out


OPTIONS = [
    dict(adam_w_mode=True, bias_correction=True, weight_decay=0.0),
    dict(adam_w_mode=True, bias_correction=True, weight_decay=0.05, capturable=True),
    dict(adam_w_mode=False, bias_correction=True, weight_decay=0.05),
    dict(adam_w_mode=False, bias_correction=False, weight_decay=0.05, capturable=True),
    dict(adam_w_mode=True, bias_correction=False, weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6),
]
# (dtype, master_weights, relative tolerance on parameters and fp32 state)
PRECISIONS = [
    (torch.float32, False, 1e-6),
    (torch.float16, False, 2e-3),
    (torch.float16, True, 1e-3),
    (torch.bfloat16, False, 1.6e-2),
    (torch.bfloat16, True, 8e-3),
]


@pytest.mark.parametrize("opts", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("dtype,master,tol", PRECISIONS, ids=lambda v: str(v))
def test_matches_float64_reference(backend_name, opts, dtype, master, tol):
    if backend_name == "triton" and dtype != torch.float32 and opts is not OPTIONS[1]:
        pytest.skip("interpreted Triton: reduced precision checked with one option set (capturable AdamW)")
    shapes = shapes_for(backend_name) if dtype == torch.float32 else shapes_for("triton")
    params = make_params(shapes, dtype)
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    kw.update(opts)
    opt = FusedAdam(params, master_weights=master, **kw)
    grads = [grads_for_step(params, s) for s in range(STEPS)]
    ref = reference_adam(params, grads, lr=kw["lr"], betas=kw["betas"], eps=kw["eps"],
                         weight_decay=kw["weight_decay"], adam_w_mode=kw["adam_w_mode"],
                         bias_correction=kw["bias_correction"],
                         store_dtype=dtype if dtype != torch.float32 and not master else None)
    for s in range(STEPS):
        set_grads(params, grads[s])
        opt.step()
    for p, (rp, rm, rv) in zip(params, ref):
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.float32 and st["exp_avg_sq"].dtype == torch.float32
        assert p.dtype == dtype
        assert rel_error(p, rp) <= tol, (p.shape, rel_error(p, rp))
        if dtype == torch.float32 or master:
            assert rel_error(st["exp_avg"], rm) <= max(tol, 1e-6) * 4
            assert rel_error(st["exp_avg_sq"], rv) <= max(tol, 1e-6) * 4
        if master:
            # fp32 arithmetic on the master; 1e-5 because coarse bf16 gradients can cancel the L2 term
            # exactly in one element, where m / (sqrt(v) + eps) is ill-conditioned.
            assert rel_error(st["master_param"], rp) <= 1e-5
        assert float(st["step"]) == STEPS


@pytest.mark.parametrize("adam_w_mode", [True, False])
@pytest.mark.parametrize("capturable", [False, True])
def test_equals_torch_optim_step_for_step(adam_w_mode, capturable):
    params = make_params(shapes_for("torch"))
    theirs = clone_params(params)
    ours = FusedAdam(params, lr=3e-3, weight_decay=0.02, adam_w_mode=adam_w_mode, capturable=capturable)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls(theirs, lr=3e-3, weight_decay=0.02)
    for s in range(STEPS):
        g = grads_for_step(params, s)
        set_grads(params, g)
        set_grads(theirs, g)
        ours.step()
        ref.step()
        for a, b in zip(params, theirs):
            assert rel_error(a, b) <= 1e-6
    for a, b in zip(params, theirs):
        for key in ("exp_avg", "exp_avg_sq"):
            assert rel_error(ours.state[a][key], ref.state[b][key]) <= 1e-6
        assert float(ours.state[a]["step"]) == float(ref.state[b]["step"])


def _train(opt, params, steps, start=0):
    for s in range(start, start + steps):
        set_grads(params, grads_for_step(params, s))
        opt.step()


@pytest.mark.parametrize("dtype,master,capturable", [(torch.float32, False, False),
                                                     (torch.float16, True, True),
                                                     (torch.bfloat16, True, False)])
def test_state_dict_round_trip_resumes_bit_for_bit(backend_name, dtype, master, capturable):
    params = make_params(shapes_for(backend_name)[:3], dtype)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01, master_weights=master, capturable=capturable)
    _train(opt, params, 3)
    mid_params, mid_state = snapshot(opt, params)
    _train(opt, params, 3, start=3)
    resumed = [torch.nn.Parameter(p.clone()) for p in mid_params]
    opt2 = FusedAdam(resumed, lr=1e-2, weight_decay=0.01, master_weights=master, capturable=capturable)
    opt2.load_state_dict(copy.deepcopy(mid_state))
    for p in resumed:
        assert opt2.state[p]["exp_avg"].dtype == torch.float32
    _train(opt2, resumed, 3, start=3)
    for a, b in zip(params, resumed):
        assert torch.equal(a, b)
    assert_state_equal(opt.state_dict(), opt2.state_dict())


def test_checkpoint_moves_to_torch_adamw_and_back():
    params = make_params(shapes_for("torch"))
    ours = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    _train(ours, params, 4)
    twins = clone_params(params)
    adamw = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1)
    adamw.load_state_dict(copy.deepcopy(ours.state_dict()))
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True
    _train(ours, params, 4, start=4)
    _train(adamw, twins, 4, start=4)
    for a, b in zip(params, twins):
        assert rel_error(a, b) <= 1e-6
    # and back: an AdamW checkpoint continues in FusedAdam
    back = clone_params(twins)
    ours2 = FusedAdam(back, lr=1e-2, weight_decay=0.1)
    ours2.load_state_dict(copy.deepcopy(adamw.state_dict()))
    _train(ours2, back, 3, start=8)
    _train(adamw, twins, 3, start=8)
    for a, b in zip(back, twins):
        assert rel_error(a, b) <= 1e-6


def test_apex_checkpoint_with_group_step_loads():
    """Apex keeps ``step`` in the param group, not in the per-parameter state."""
    params = make_params([(10,), (4,)])
    ours = FusedAdam(params, lr=1e-2)
    _train(ours, params, 3)
    sd = copy.deepcopy(ours.state_dict())
    for st in sd["state"].values():
        del st["step"]
    sd["param_groups"][0]["step"] = 3
    twins = clone_params(params)
    ours2 = FusedAdam(twins, lr=1e-2)
    ours2.load_state_dict(sd)
    _train(ours, params, 2, start=3)
    _train(ours2, twins, 2, start=3)
    for a, b in zip(params, twins):
        assert torch.equal(a, b)


@pytest.mark.parametrize("capturable", [True, False])
def test_grad_scaler_inf_step_leaves_everything_untouched(backend_name, capturable):
    # GradScaler.unscale_ (the non-capturable protocol) refuses fp16 gradients; bf16 exercises it.
    dtype = torch.float16 if capturable else torch.bfloat16
    params = make_params(shapes_for(backend_name)[:3], dtype)
    opt = FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=capturable, master_weights=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    scaler.scale(torch.ones(()))  # initialises the scale, as scaling a loss does
    for s in range(2):
        for p, g in zip(params, grads_for_step(params, s, scale=2.0 ** 10)):
            p.grad = g
        scaler.step(opt)
        scaler.update()
    before_p, before_state = snapshot(opt, params)
    scale_before = scaler.get_scale()
    for p, g in zip(params, grads_for_step(params, 7, scale=2.0 ** 10)):
        p.grad = g
    params[1].grad.view(-1)[0] = float("inf")
    with pytest.warns(FutureWarning) if capturable else _nullcontext():
        scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < scale_before
    for a, b in zip(params, before_p):
        assert torch.equal(a, b)
    assert_state_equal(opt.state_dict(), before_state)
    # A finite step afterwards is unscaled inside the update and matches an unscaled FusedAdam.
    twins = clone_params(params)
    ref = FusedAdam(twins, lr=1e-2, weight_decay=0.01, capturable=capturable, master_weights=True)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    g = grads_for_step(params, 9)
    scale = scaler.get_scale()
    for p, t, gg in zip(params, twins, g):
        p.grad = (gg.float() * scale).to(dtype)
        t.grad = gg.clone()
    scaler.step(opt)
    ref.step()
    for a, b in zip(params, twins):
        assert torch.equal(a, b)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_capturable_step_with_explicit_grad_scaler_after_unscale():
    params = make_params([(33,), (5,)])
    twins = clone_params(params)
    opt = FusedAdam(params, lr=1e-2, capturable=True)
    ref = FusedAdam(twins, lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))
    g = grads_for_step(params, 0)
    for p, t, gg in zip(params, twins, g):
        p.grad = gg * 256.0
        t.grad = gg.clone()
    scaler.unscale_(opt)  # already unscaled: the step must not unscale a second time
    scaler.step(opt)
    ref.step()
    for a, b in zip(params, twins):
        assert torch.equal(a, b)


def _watch_all(tr, opt):
    for group in opt.param_groups:
        for p in group["params"]:
            tr.watch(p, p.grad, [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)])


def test_one_launch_per_dtype_group_and_bounds(triton_device):
    pytest.importorskip("triton")
    shapes = [(1,), (3,), (4097,), (5, 7, 3)]
    params = make_params(shapes) + make_params(shapes, torch.float16, seed=3) + make_params(
        shapes, torch.bfloat16, seed=4)
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    set_grads(params, grads_for_step(params, 0))
    opt.step()  # creates the state, so that the traced step can watch every tensor it touches
    for capturable in (False, True):
        opt.capturable = capturable
        if capturable:
            for g in opt.param_groups:
                opt._lr_to_device(g)
        with apex.backend("triton"), TritonTrace(bounds=True) as tr:
            _watch_all(tr, opt)
            opt.step()
        assert tr.launches == 3, tr.kernels  # fp32, fp16 + master, bf16 + master


def test_closure_params_without_grads_and_add_param_group(backend_name):
    params = make_params([(7,), (9,)])
    frozen = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdam([{"params": params}, {"params": [frozen]}], lr=0.1)
    target = torch.randn(7)

    def closure():
        opt.zero_grad()
        loss = ((params[0] - target) ** 2).sum() + params[1].sum()
        loss.backward()
        return loss

    before = frozen.detach().clone()
    loss0 = opt.step(closure)
    assert isinstance(loss0, torch.Tensor)
    assert torch.equal(frozen, before) and len(opt.state[frozen]) == 0
    extra = torch.nn.Parameter(torch.randn(4))
    opt.add_param_group({"params": [extra], "lr": 0.5, "weight_decay": 0.1})
    assert opt.param_groups[-1]["betas"] == (0.9, 0.999)
    e0 = extra.detach().clone()

    def closure2():
        loss = closure()
        extra.sum().backward()  # a unit gradient
        return loss

    opt.step(closure2)
    # AdamW first step with bias correction moves each element by lr * (1 + wd * p) for a unit gradient
    expected = e0 - 0.5 * (1.0 / (1.0 + 1e-8) + 0.1 * e0)
    assert torch.allclose(extra, expected, rtol=1e-6, atol=1e-6)
    for _ in range(20):
        loss = opt.step(closure)
    assert loss < loss0


def test_set_grad_none():
    p = torch.nn.Parameter(torch.randn(3))
    for flag, expect_none in [(True, True), (False, False)]:
        opt = FusedAdam([p], set_grad_none=flag)
        p.grad = torch.ones(3)
        opt.zero_grad()
        assert (p.grad is None) == expect_none
        if not expect_none:
            assert torch.equal(p.grad, torch.zeros(3))


def test_constructor_defaults_and_attributes():
    import inspect

    sig = inspect.signature(FusedAdam.__init__)
    assert {k: v.default for k, v in list(sig.parameters.items())[2:]} == dict(
        lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True, weight_decay=0.0,
        amsgrad=False, set_grad_none=True, capturable=False, master_weights=False)
    opt = FusedAdam([torch.nn.Parameter(torch.randn(2))])
    import amp_C

    assert opt.multi_tensor_adam is amp_C.multi_tensor_adam
    assert opt.multi_tensor_adam_capturable is amp_C.multi_tensor_adam_capturable
    assert opt.multi_tensor_adam_capturable_master is amp_C.multi_tensor_adam_capturable_master
    assert opt.adam_w_mode == 1 and opt._dummy_overflow_buf.dtype == torch.int32
    cap = FusedAdam([torch.nn.Parameter(torch.randn(2))], lr=0.5, capturable=True)
    assert isinstance(cap.param_groups[0]["lr"], torch.Tensor) and cap._step_supports_amp_scaling


@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(amsgrad=True), RuntimeError, "AMSGrad"),
    (dict(lr=-1e-3), ValueError, "lr"),
    (dict(eps=-1.0), ValueError, "eps"),
    (dict(betas=(1.0, 0.999)), ValueError, "betas"),
    (dict(betas=(0.9, -0.1)), ValueError, "betas"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(lr=math.nan), ValueError, "lr"),
])
def test_bad_hyperparameters(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        FusedAdam([torch.nn.Parameter(torch.randn(2))], **kwargs)


def _bad_grad(kind):
    good = torch.nn.Parameter(torch.randn(6))
    bad = torch.nn.Parameter(torch.randn(4))
    good.grad = torch.randn(6)
    if kind == "sparse":
        bad.grad = torch.randn(4).to_sparse()
    elif kind == "dtype":
        bad.grad = torch.randn(4)
        bad.grad.data = torch.randn(4).half()
    elif kind == "shape":
        bad.grad = torch.randn(4)
        bad.grad.data = torch.randn(5)
    elif kind == "device":
        bad = torch.nn.Parameter(torch.randn(4, device="meta"))
        bad.grad = torch.randn(4, device="meta")
    return good, bad


@pytest.mark.parametrize("kind,word", [("sparse", "sparse"), ("dtype", "dtype"), ("shape", "shape"),
                                       ("device", "device")])
def test_bad_gradients_raise_and_change_nothing(kind, word):
    good, bad = _bad_grad(kind)
    opt = FusedAdam([good, bad], lr=0.1)
    p0 = good.detach().clone()
    with pytest.raises(RuntimeError, match=word):
        opt.step()
    assert torch.equal(good, p0)
    assert len(opt.state) == 0


def test_deprecated_step_arguments_raise():
    opt = FusedAdam([torch.nn.Parameter(torch.randn(2))])
    with pytest.raises(RuntimeError, match="step\\(\\) with no arguments"):
        opt.step(scale=2.0)


def test_channels_last_params_and_grads_of_another_layout(backend_name):
    p = torch.nn.Parameter(torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last))
    q = torch.nn.Parameter(p.detach().clone())
    ours, ref = FusedAdam([p], lr=0.1), torch.optim.AdamW([q], lr=0.1, weight_decay=0.0)
    for s, layout in enumerate([torch.channels_last, torch.contiguous_format, torch.channels_last]):
        g = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(s))
        p.grad = g.clone().contiguous(memory_format=layout)
        q.grad = g.clone()
        ours.step()
        ref.step()
        assert rel_error(p, q) <= 1e-6
    assert ours.state[p]["exp_avg"].is_contiguous(memory_format=torch.channels_last)
