"""FusedMixedPrecisionLamb: fp32 masters, device-side lr/step, GradScaler handling, against the LAMB rule."""

from __future__ import annotations

import copy

import pytest
import torch

import apex
from apex.optimizers import FusedMixedPrecisionLamb
from apex.testing import TritonTrace, assert_rel_close
from tests.optimizers._common import counting_tables

from ._lamb_reference import bf16_round_to_nearest
from ._lamb_reference import lamb as ref_lamb

SMALL = [(1,), (3,), (4097,), (2, 3, 5)]
STEPS = 10
OPTIONS = [{}, {"weight_decay": 0.0}, {"adam_w_mode": False, "use_nvlamb": True, "bias_correction": False},
           {"grad_averaging": False, "max_grad_norm": 100.0}]


def _ids(o: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in o.items()) or "default"


def _reference(init, grad_seq, opts):
    hp = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=opts.get("weight_decay", 0.01),
              bias_correction=opts.get("bias_correction", True),
              grad_averaging=opts.get("grad_averaging", True))
    return ref_lamb([x.double() for x in init], grad_seq, [(range(len(init)), hp)],
                    max_grad_norm=opts.get("max_grad_norm", 1.0), adam_w_mode=opts.get("adam_w_mode", True),
                    use_nvlamb=opts.get("use_nvlamb", False))


def _train(dtype, opts, scaler_scale=None, steps=STEPS, how="scaler.step"):
    gen = torch.Generator().manual_seed(3)
    init = [torch.randn(s, generator=gen).to(dtype) for s in SMALL]
    grad_seq = [[torch.randn(s, generator=gen).to(dtype) for s in SMALL] for _ in range(steps)]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    reduced = dtype if dtype != torch.float32 else None
    opt = FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=reduced, **opts)
    scaler = torch.amp.GradScaler("cpu", init_scale=scaler_scale) if scaler_scale else None
    for grads in grad_seq:
        for p, g in zip(params, grads):
            p.grad = g.clone() if scaler is None else (g.float() * scaler_scale).to(dtype)
        if scaler is None:
            opt.step()
        elif how == "step(None, scaler)":  # Apex's own call, positional
            scaler.scale(torch.ones(()))
            opt.step(None, scaler)
        else:
            scaler.scale(torch.ones(()))
            if how == "unscale_ then scaler.step":
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
    return opt, params, init, grad_seq


@pytest.mark.parametrize("opts", OPTIONS, ids=_ids)
def test_fp32_matches_reference(backend_name, opts):
    opt, params, init, grad_seq = _train(torch.float32, opts)
    p_ref, _, _ = _reference(init, grad_seq, opts)
    for p, r in zip(params, p_ref):
        assert_rel_close(p.detach(), r, tol=1e-6)
    group = opt.param_groups[0]
    assert isinstance(group["lr"], torch.Tensor) and group["step"].tolist() == [STEPS]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reduced_precision_keeps_exact_fp32_masters(backend_name, dtype):
    # The masters follow the fp32 rule fed with the (exactly representable) reduced-precision gradients;
    # the model parameters are the masters rounded once.
    with bf16_round_to_nearest():
        opt, params, init, grad_seq = _train(dtype, {})
    p_ref, m_ref, _ = _reference(init, grad_seq, {})
    for p, r in zip(params, p_ref):
        st = opt.state[p]
        assert st["exp_avg"].dtype == torch.float32 and st["master_param"].dtype == torch.float32
        assert_rel_close(st["master_param"], r, tol=1e-6)
        assert torch.equal(p.detach(), st["master_param"].to(dtype))
    assert opt.param_groups_full_precision[0]["params"][0] is opt.state[params[0]]["master_param"]


@pytest.mark.parametrize("how", ["scaler.step", "unscale_ then scaler.step", "step(None, scaler)"])
def test_grad_scaler_unscales_inside_the_update(backend_name, how):
    # A power-of-two scale makes unscaling exact: the result equals unscaled training.
    opt, params, init, grad_seq = _train(torch.float32, {}, scaler_scale=1024.0, steps=4, how=how)
    p_ref, _, _ = _reference(init, grad_seq, {})
    for p, r in zip(params, p_ref):
        assert_rel_close(p.detach(), r, tol=1e-6)


@pytest.mark.parametrize("use_scaler", [True, False], ids=["grad_scaler", "no_scaler"])
def test_inf_step_changes_nothing(backend_name, use_scaler):
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in (3, 4097)]
    opt = FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0)

    def step():
        if use_scaler:
            scaler.scale(torch.ones(()))
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    for p in params:
        p.grad = torch.randn_like(p)
    step()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad[5] = float("inf")
    step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before[0]))
    after = opt.state_dict()
    assert after["param_groups"][0]["step"].tolist() == [1]
    for k, st in after["state"].items():
        for name, t in st.items():
            assert torch.equal(t, before[1]["state"][k][name]), name
    if use_scaler:
        assert scaler.get_scale() == 32.0
    for p in params:  # and the next finite step goes through
        p.grad = torch.randn_like(p)
    step()
    assert opt.param_groups[0]["step"].tolist() == [2]
    assert not torch.equal(params[0].detach(), before[0][0])


def test_state_dict_round_trip_is_bit_exact(backend_name):
    shapes = [(5,), (4097,)]
    grads = [[torch.randn(s).half() for s in shapes] for _ in range(6)]
    a = [torch.nn.Parameter(torch.randn(s).half()) for s in shapes]
    opt_a = FusedMixedPrecisionLamb(a, lr=1e-2, reduced_precision_dtype=torch.float16)
    for gs in grads[:3]:
        for p, g in zip(a, gs):
            p.grad = g.clone()
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    opt_b = FusedMixedPrecisionLamb(b, lr=1e-2, reduced_precision_dtype=torch.float16)
    opt_b.load_state_dict(saved)
    assert opt_b.state[b[0]]["exp_avg"].dtype == torch.float32
    for gs in grads[3:]:
        for pa, pb, g in zip(a, b, gs):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(opt_a.state[x]["master_param"], opt_b.state[y]["master_param"])


def test_lr_scheduler_and_param_groups(backend_name):
    w1, w2 = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    opt = FusedMixedPrecisionLamb([w1], lr=1e-2)
    opt.add_param_group({"params": [w2], "lr": 5e-3})
    assert opt.param_groups[0]["step"] is not opt.param_groups[1]["step"]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        w1.grad, w2.grad = torch.randn(4), torch.randn(3)
        opt.step()
        sched.step()
    assert float(opt.param_groups[0]["lr"]) == pytest.approx(2.5e-3)
    assert [g["step"].item() for g in opt.param_groups] == [2, 2]


def test_triton_launches_are_constant_and_in_bounds(triton_device):
    def launches(n):
        params = [torch.nn.Parameter(torch.randn(3 + 11 * i).half()) for i in range(n)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = FusedMixedPrecisionLamb(params, reduced_precision_dtype=torch.float16)
        with apex.backend("triton"):
            opt.step()
            with TritonTrace(bounds=True) as tr:
                state = [t for s in opt.state.values() for t in s.values()]
                tr.watch(params, [p.grad for p in params], state)
                opt.step()
        return tr.launches, dict(tr.kernels)

    few, kernels = launches(3)
    many, _ = launches(25)
    assert few == many and kernels["_moments_kernel"] == kernels["_apply_kernel"] == 1, kernels


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "grad_scale"])
def test_new_gradients_cost_one_device_table_per_step(triton_device, scaled):
    """With new gradient tensors at every step, the global norm's partials and the update's launches read one
    table per list kind (masters + model copies, and parameters without masters) with the new addresses; also
    with gradients that carry a loss scale (``grad_scale``, a power of two: the same values as unscaled)."""
    reduced = [torch.nn.Parameter(torch.randn(5 + i).bfloat16()) for i in range(4)]
    full = [torch.nn.Parameter(torch.randn(3 + i)) for i in range(2)]  # fp32: no master
    params = reduced + full
    opt = FusedMixedPrecisionLamb([{"params": reduced}, {"params": full}], lr=1e-2,
                                  reduced_precision_dtype=torch.bfloat16)
    with apex.backend("triton"):
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            if step == 2:
                twin = copy.deepcopy(opt)
                twin_params = [q for g in twin.param_groups for q in g["params"]]
                for p, q in zip(params, twin_params):
                    q.grad = p.grad.clone()
                    if scaled:
                        p.grad = p.grad * 4
                twin._plans = {}
                if scaled:
                    opt.grad_scale, opt.found_inf = torch.tensor(4.0), torch.zeros(1)
                with counting_tables() as built:
                    opt.step()
            else:
                opt.step()
        twin.step()
    assert len(built) == 2, built
    for p, q in zip(params, twin_params):
        assert torch.equal(p.detach(), q.detach())


@pytest.mark.parametrize("kwargs, exc, word", [
    ({"amsgrad": True}, RuntimeError, "AMSGrad"),
    ({"lr": -1.0}, ValueError, "lr"),
    ({"betas": (0.9, 1.5)}, ValueError, "betas"),
    ({"reduced_precision_dtype": torch.int8}, ValueError, "reduced_precision_dtype"),
])
def test_bad_constructor_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        FusedMixedPrecisionLamb([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_bad_gradient_changes_nothing(backend_name):
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = FusedMixedPrecisionLamb(params)
    params[0].grad = torch.randn(4)
    params[1].grad = torch.randn(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert opt.param_groups[0]["step"].tolist() == [0] and len(opt.state) == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cpu_gradients_converted_for_the_norm_give_the_generic_step(dtype):
    """On the CPU the reduced-precision gradients are converted to fp32 once, for the global norm and the
    update; the step equals the one of the generic path (each op converting for itself, as a subclass
    with its own l2norm op gets), and the model's gradients are left as they were."""
    from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm_mp

    shapes = [(5,), (4097,), (2, 3, 5), (70000,), (5,)]
    gen = torch.Generator().manual_seed(9)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grad_seq = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(3)]
    runs = []
    for converted in (True, False):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = FusedMixedPrecisionLamb(params, lr=1e-2, reduced_precision_dtype=dtype)
        if not converted:
            opt.multi_tensor_l2norm = lambda *a, **k: multi_tensor_l2norm_mp(*a, **k)
        for grads in grad_seq:
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))
        runs.append([opt.state[p]["master_param"] for p in params])
    for a, b in zip(*runs):
        assert_rel_close(a, b.double(), tol=1e-6)
