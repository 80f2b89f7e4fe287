"""FusedLAMB against the documented LAMB rule (float64, one parameter at a time), on both backends."""

from __future__ import annotations

import copy

import pytest
import torch

import apex
from apex.optimizers import FusedLAMB
from apex.testing import TritonTrace, assert_rel_close
from tests.optimizers._common import counting_tables, set_grad_of_another_dtype

from ._lamb_reference import bf16_round_to_nearest
from ._lamb_reference import lamb as ref_lamb

SMALL = [(1,), (3,), (4097,), (2, 3, 5)]
RAGGED = [(1,), (3,), (4097,), (65537,), (2, 3, 5)]
STEPS = 10

OPTIONS = [
    {},
    {"weight_decay": 0.0},
    {"weight_decay": 0.0, "use_nvlamb": True},
    {"adam_w_mode": False},
    {"bias_correction": False},
    {"grad_averaging": False},
    {"max_grad_norm": 100.0},
    {"adam_w_mode": False, "grad_averaging": False, "bias_correction": False, "weight_decay": 0.1},
]


def _hp(opts: dict, lr: float, wd: float) -> dict:
    return dict(lr=lr, betas=opts.get("betas", (0.9, 0.999)), eps=opts.get("eps", 1e-6), weight_decay=wd,
                bias_correction=opts.get("bias_correction", True),
                grad_averaging=opts.get("grad_averaging", True))


def _run(shapes, opts, dtype=torch.float32, steps=STEPS, scale=1.0):
    """Two groups (the second with its own lr and weight decay 0) and one parameter without a gradient."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grad_seq = [[(torch.randn(s, generator=gen) * scale).to(dtype) for s in shapes] for _ in range(steps)]
    for grads in grad_seq:
        grads[1] = None  # a parameter that never gets a gradient
    params = [torch.nn.Parameter(x.clone()) for x in init]
    wd = opts.get("weight_decay", 0.01)
    split = len(shapes) // 2
    kw = {k: v for k, v in opts.items() if k != "weight_decay"}
    opt = FusedLAMB([{"params": params[:split]}, {"params": params[split:], "lr": 3e-2, "weight_decay": 0.0}],
                    lr=1e-2, weight_decay=wd, **kw)
    for grads in grad_seq:
        for p, g in zip(params, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    groups = [(range(split), _hp(opts, 1e-2, wd)), (range(split, len(shapes)), _hp(opts, 3e-2, 0.0))]
    ref_kw = dict(max_grad_norm=opts.get("max_grad_norm", 1.0), adam_w_mode=opts.get("adam_w_mode", True),
                  use_nvlamb=opts.get("use_nvlamb", False))
    ref = ref_lamb(init, grad_seq, groups, **ref_kw)
    base = ref_lamb(init, grad_seq, groups, dtype=dtype, **ref_kw) if dtype != torch.float32 else None
    return opt, params, init, ref, base


def _check_state(opt, params, idx, m_ref, v_ref, tol=1e-6):
    # Moments are compared over the whole model: one element of a moment can be a cancellation
    # (a sum of gradients of both signs) whose own relative error means nothing.
    for key, ref in (("exp_avg", m_ref), ("exp_avg_sq", v_ref)):
        out = torch.cat([opt.state[params[i]][key].reshape(-1) for i in idx])
        assert_rel_close(out, torch.cat([ref[i].reshape(-1) for i in idx]), tol=tol, name=key)


def _ids(o: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in o.items()) or "default"


@pytest.mark.parametrize("opts", OPTIONS, ids=_ids)
def test_matches_reference_fp32(backend_name, opts):
    opt, params, init, (p_ref, m_ref, v_ref), _ = _run(SMALL, opts)
    assert torch.equal(params[1].detach(), init[1]) and params[1] not in opt.state
    for i in (0, 2, 3):
        assert_rel_close(params[i].detach(), p_ref[i], tol=1e-6, name=f"param {i}")
    _check_state(opt, params, (0, 2, 3), m_ref, v_ref)
    assert [g["step"] for g in opt.param_groups] == [STEPS, STEPS]


def test_ragged_sizes_fp32(backend_name):
    opt, params, _, (p_ref, m_ref, v_ref), _ = _run(RAGGED, {})
    for i in (0, 2, 3, 4):
        assert_rel_close(params[i].detach(), p_ref[i], tol=1e-6, name=f"param {i}")
    _check_state(opt, params, (0, 2, 3, 4), m_ref, v_ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reduced_precision(backend_name, dtype):
    with bf16_round_to_nearest():
        _check_reduced_precision(dtype)


def _check_reduced_precision(dtype):
    # State is kept in the parameter's dtype, as in Apex; the math is fp32. Allowed error: twice that of
    # the same rule computed by PyTorch in that dtype. The interpreter is made to round fp32 -> bf16 to
    # nearest even, as GPUs do (it truncates by default).
    opt, params, _, (p_ref, _, _), (p_base, _, _) = _run(SMALL, {}, dtype=dtype, steps=STEPS)
    for i in (0, 2, 3):
        assert params[i].dtype == dtype and opt.state[params[i]]["exp_avg"].dtype == dtype
        assert_rel_close(params[i].detach(), p_ref[i], dtype, baseline=p_base[i], name=f"param {i}")


def test_gradients_are_left_or_clipped(backend_name):
    # The Triton path never writes the gradients; the CPU path may leave them divided by the clip factor
    # (Apex's kernel overwrites them with the update).
    p = torch.nn.Parameter(torch.randn(100))
    g = torch.randn(100) * 10
    p.grad = g.clone()
    FusedLAMB([p]).step()
    if backend_name == "triton":
        assert torch.equal(p.grad, g)
    else:
        assert torch.equal(p.grad, g) or torch.allclose(p.grad, g / g.norm(), rtol=1e-6)


def _train(opt, params, grads):
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()


def test_state_dict_round_trip_is_bit_exact(backend_name):
    shapes = [(5,), (4097,), (2, 3, 5)]
    grads = [[torch.randn(s) for s in shapes] for _ in range(6)]
    init = [torch.randn(s) for s in shapes]
    a = [torch.nn.Parameter(x.clone()) for x in init]
    opt_a = FusedLAMB(a, lr=1e-2, use_nvlamb=True)
    _train(opt_a, a, grads[:3])
    saved = copy.deepcopy(opt_a.state_dict())
    assert set(saved["state"][0]) == {"exp_avg", "exp_avg_sq"} and saved["param_groups"][0]["step"] == 3
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    opt_b = FusedLAMB(b, lr=1e-2, use_nvlamb=True)
    opt_b.load_state_dict(saved)
    _train(opt_a, a, grads[3:])
    _train(opt_b, b, grads[3:])
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(opt_a.state[x]["exp_avg_sq"], opt_b.state[y]["exp_avg_sq"])


def test_grad_scaler_inf_step_changes_nothing(backend_name):
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(3,), (4097,)]]
    opt = FusedLAMB(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for p in params:
        p.grad = torch.randn_like(p) * 1024
    scaler.scale(torch.ones(()))
    scaler.step(opt)
    scaler.update()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad[7] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 512.0
    for p, q in zip(params, before[0]):
        assert torch.equal(p.detach(), q)
    after = opt.state_dict()
    assert after["param_groups"][0]["step"] == before[1]["param_groups"][0]["step"] == 1
    for k, st in after["state"].items():
        for name, t in st.items():
            assert torch.equal(t, before[1]["state"][k][name])


def test_triton_launches_are_constant_and_in_bounds(triton_device):
    def launches(n_params):
        params = [torch.nn.Parameter(torch.randn(7 + 13 * i)) for i in range(n_params)]
        half = [torch.nn.Parameter(torch.randn(5).half()) for _ in range(2)]
        for p in params + half:
            p.grad = torch.randn_like(p)
        opt = FusedLAMB([{"params": params + half}, {"params": [], "weight_decay": 0.0}], lr=1e-2)
        with apex.backend("triton"):
            opt.step()  # creates the state
            with TritonTrace(bounds=True) as tr:
                tr.watch(params, half, [p.grad for p in params + half],
                         [t for st in opt.state.values() for t in st.values()])
                opt.step()
        return tr.launches, dict(tr.kernels)

    few, kernels = launches(3)
    many, _ = launches(40)
    assert few == many, (few, many)
    # Per step: the global norm (per-dtype partials + finalize), then per dtype group: moments, per-tensor
    # reduction, apply.
    assert kernels["_moments_kernel"] == kernels["_apply_kernel"] == kernels["_reduce_kernel"] == 2
    assert few <= 3 + 3 * 2


def test_no_trust_ratio_is_a_single_pass(triton_device):
    params = [torch.nn.Parameter(torch.randn(s)) for s in (3, 4097)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = FusedLAMB(params, weight_decay=0.0)
    with apex.backend("triton"):
        opt.step()
        with TritonTrace(bounds=True) as tr:
            tr.watch(params, [p.grad for p in params], [t for st in opt.state.values() for t in st.values()])
            opt.step()
    assert tr.kernels["_moments_kernel"] == 1 and "_apply_kernel" not in tr.kernels


def test_new_gradients_cost_one_device_table_per_step(triton_device):
    """With new gradient tensors at every step (``zero_grad(set_to_none=True)``), the global norm's partials,
    the moments and the apply launches all read one table with the new gradients' addresses: a table per
    launch costs its own upload."""
    params = [torch.nn.Parameter(torch.randn(5 + i)) for i in range(6)]
    opt = FusedLAMB(params, lr=1e-2)  # weight decay: the trust ratio's moments, reduction and apply launches
    twin = copy.deepcopy(opt)
    with apex.backend("triton"):
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            if step == 2:
                for p, q in zip(params, twin.param_groups[0]["params"]):
                    q.grad = p.grad.clone()
                with counting_tables() as built:
                    opt.step()
                twin.step()  # (its first step: plans and tables of its own)
            else:
                opt.step()
                if step == 1:
                    twin = copy.deepcopy(opt)
    assert len(built) == 1, built
    for p, q in zip(params, twin.param_groups[0]["params"]):
        assert torch.equal(p.detach(), q.detach())


def test_closure_and_zero_grad(backend_name):
    w = torch.nn.Parameter(torch.randn(4))
    opt = FusedLAMB([w], lr=1e-2)

    def closure():
        opt.zero_grad()
        loss = (w * w).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) > 0 and w.grad is not None
    opt.zero_grad()
    assert w.grad is None
    opt2 = FusedLAMB([w], set_grad_none=False)
    w.grad = torch.ones(4)
    opt2.zero_grad()
    assert torch.equal(w.grad, torch.zeros(4))


@pytest.mark.parametrize("kwargs, exc, word", [
    ({"amsgrad": True}, RuntimeError, "AMSGrad"),
    ({"lr": -1.0}, ValueError, "lr"),
    ({"eps": -1e-6}, ValueError, "eps"),
    ({"betas": (1.0, 0.999)}, ValueError, "betas[0]"),
    ({"betas": (0.9, -0.1)}, ValueError, "betas[1]"),
    ({"weight_decay": -0.1}, ValueError, "weight_decay"),
    ({"max_grad_norm": -1.0}, ValueError, "max_grad_norm"),
])
def test_bad_constructor_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word.replace("[", r"\[").replace("]", r"\]")):
        FusedLAMB([torch.nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize("bad", ["sparse", "dtype", "shape", "device"])
def test_bad_gradients_change_nothing(backend_name, bad):
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    opt = FusedLAMB(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    for p in params:
        p.grad = torch.randn_like(p)
    if bad == "sparse":
        params[2].grad = torch.randn(4).to_sparse()
        err = RuntimeError
    elif bad == "dtype":
        set_grad_of_another_dtype(params[2], torch.randn(4, dtype=torch.float16))
        err = RuntimeError
    elif bad == "shape":
        # The setter checks the shape; set_ does not. (A reused plan compares sizes, as Apex's engine does:
        # a gradient reshaped in place to its parameter's size is not seen.)
        params[2].grad.set_(torch.randn(5))
        err = RuntimeError
    else:
        other = "cpu" if params[0].device.type == "meta" else "meta"  # meta: APEX_TEST_DEVICE=meta's device
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2)),
                                        torch.nn.Parameter(torch.randn(2, device=other))]})
        err = ValueError
    with pytest.raises(err, match="sparse|gradient|device"):
        opt.step()
    for p, q in zip(params, before[0]):
        assert torch.equal(p.detach(), q)
    assert opt.param_groups[0]["step"] == 1
    for k, st in opt.state_dict()["state"].items():
        for name, t in st.items():
            assert torch.equal(t, before[1]["state"][k][name])


def test_non_contiguous_gradient(backend_name):
    # A transposed gradient (as some custom autograd functions produce) gives the same step.
    results = []
    for transposed in (False, True):
        torch.manual_seed(5)
        p = torch.nn.Parameter(torch.randn(3, 70))
        g = torch.randn(70, 3)
        p.grad = g.t() if transposed else g.t().contiguous()
        assert p.grad.is_contiguous() != transposed
        FusedLAMB([p], lr=1e-2).step()
        results.append(p.detach().clone())
    assert torch.equal(results[0], results[1])
