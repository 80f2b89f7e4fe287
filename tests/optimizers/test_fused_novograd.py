"""FusedNovoGrad against the documented NovoGrad rule (float64, one parameter at a time), on both backends."""

from __future__ import annotations

import copy

import pytest
import torch

import apex
from apex.optimizers import FusedNovoGrad
from apex.testing import TritonTrace, assert_rel_close
from tests.optimizers._common import counting_tables, set_grad_of_another_dtype

from ._lamb_reference import bf16_round_to_nearest
from ._lamb_reference import novograd as ref_novograd

SMALL = [(1,), (3,), (4097,), (2, 3, 5)]
RAGGED = [(1,), (3,), (4097,), (65537,), (2, 3, 5)]
STEPS = 10

OPTIONS = [
    {},
    {"norm_type": 0},
    {"init_zero": True},
    {"reg_inside_moment": True, "weight_decay": 0.01},
    {"weight_decay": 0.01},
    {"bias_correction": False, "grad_averaging": False},
    {"norm_type": 0, "init_zero": True, "reg_inside_moment": True, "weight_decay": 0.05,
     "grad_averaging": False},
]


def _ids(o: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in o.items()) or "default"


def _hp(opts):
    return dict(lr=1e-2, betas=(0.95, 0.98), eps=1e-8, weight_decay=opts.get("weight_decay", 0.0),
                bias_correction=opts.get("bias_correction", True),
                grad_averaging=opts.get("grad_averaging", True),
                norm_type=opts.get("norm_type", 2), init_zero=opts.get("init_zero", False))


def _run(shapes, opts, dtype=torch.float32, steps=STEPS):
    gen = torch.Generator().manual_seed(2)
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grad_seq = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    params = [torch.nn.Parameter(x.clone()) for x in init]
    opt = FusedNovoGrad(params, lr=1e-2, betas=(0.95, 0.98), **opts)
    for grads in grad_seq:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    reg = opts.get("reg_inside_moment", False)
    ref = ref_novograd(init, grad_seq, _hp(opts), reg_inside_moment=reg)
    base = ref_novograd(init, grad_seq, _hp(opts), reg_inside_moment=reg, dtype=dtype)
    return opt, params, ref, base


@pytest.mark.parametrize("opts", OPTIONS, ids=_ids)
def test_matches_reference_fp32(backend_name, opts):
    opt, params, (p_ref, m_ref, n_ref), _ = _run(SMALL, opts)
    for i in range(len(params)):
        assert_rel_close(params[i].detach(), p_ref[i], tol=1e-6, name=f"param {i}")
    m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in params])
    assert_rel_close(m, torch.cat([x.reshape(-1) for x in m_ref]), tol=1e-6, name="exp_avg")
    # Apex's layout: [norms of fp16 params, norms of fp32 params], kept in the group.
    norms = opt.param_groups[0]["exp_avg_sq"]
    assert len(norms) == 2 and norms[0].numel() == 0 and norms[1].dtype == torch.float32
    assert_rel_close(norms[1], torch.tensor(n_ref, dtype=torch.float64), tol=1e-6, name="norms")
    assert opt.param_groups[0]["step"] == STEPS


def test_ragged_sizes_fp32(backend_name):
    opt, params, (p_ref, _, _), _ = _run(RAGGED, {"weight_decay": 0.01})
    for i in range(len(params)):
        assert_rel_close(params[i].detach(), p_ref[i], tol=1e-6, name=f"param {i}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_reduced_precision(backend_name, dtype):
    with bf16_round_to_nearest():
        _check_reduced_precision(dtype)


def _check_reduced_precision(dtype):
    # exp_avg in the parameter's dtype (Apex's), norms in fp32, math in fp32. Allowed error: twice that of
    # PyTorch computing the rule in that dtype; the interpreter is made to round fp32 -> bf16 to nearest
    # even, as GPUs do.
    opt, params, (p_ref, _, _), (p_base, _, _) = _run(SMALL, {"weight_decay": 0.01}, dtype=dtype)
    for i in range(len(params)):
        assert_rel_close(params[i].detach(), p_ref[i], dtype, baseline=p_base[i], name=f"param {i}")
    slots = opt.param_groups[0]["exp_avg_sq"]
    slot = 0 if dtype == torch.float16 else 2
    assert slots[slot].numel() == len(params) and slots[1].numel() == 0


def test_mixed_dtypes_in_one_group(backend_name):
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(6).half()),
              torch.nn.Parameter(torch.randn(7))]
    opt = FusedNovoGrad(params, lr=1e-2)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    fp16, fp32 = opt.param_groups[0]["exp_avg_sq"]
    assert fp16.numel() == 1 and fp32.numel() == 2


def _resume(shapes, reload, check_saved=lambda opt: None):
    """Three steps, a checkpoint passed through ``reload`` into a second optimizer, then three more steps
    of both: the two parameter lists and optimizers."""
    grads = [[torch.randn(s) for s in shapes] for _ in range(6)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt_a = FusedNovoGrad(a, lr=1e-2, weight_decay=0.01)
    for gs in grads[:3]:
        for p, g in zip(a, gs):
            p.grad = g.clone()
        opt_a.step()
    check_saved(opt_a)
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    opt_b = FusedNovoGrad(b, lr=1e-2, weight_decay=0.01)
    opt_b.load_state_dict(reload(opt_a.state_dict()))
    for gs in grads[3:]:
        for pa, pb, g in zip(a, b, gs):
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        assert torch.equal(opt_a.state[x]["exp_avg"], opt_b.state[y]["exp_avg"])
    return a, b, opt_a, opt_b


def test_state_dict_round_trip_is_bit_exact(backend_name):
    def reload(saved):
        saved = copy.deepcopy(saved)
        assert set(saved["state"][0]) == {"exp_avg"} and "exp_avg_sq" in saved["param_groups"][0]
        return saved

    _, _, opt_a, opt_b = _resume([(5,), (4097,), (2, 3, 5)], reload)
    assert torch.equal(opt_a.param_groups[0]["exp_avg_sq"][1], opt_b.param_groups[0]["exp_avg_sq"][1])


def test_cpu_moments_of_small_params_share_one_buffer_and_reload_from_a_file():
    """On the CPU, the moments of the small fp32 parameters are views of one buffer (one op updates them
    all); they stay ordinary tensors, and a checkpoint read back from a file resumes bit for bit."""
    import io

    from apex.ops._cpu_packed import PACK_ELEMENTS

    def packed(opt):
        params = opt.param_groups[0]["params"]
        small = [(opt.state[p]["exp_avg"], p) for p in params if p.numel() <= PACK_ELEMENTS]
        assert len(small) == 4 and len({m.untyped_storage().data_ptr() for m, _ in small}) == 1
        assert all(not m.is_inference() and m.shape == p.shape for m, p in small)

    def through_a_file(saved):
        buf = io.BytesIO()
        torch.save(saved, buf)
        buf.seek(0)
        return torch.load(buf)

    _, b, _, opt_b = _resume([(5,), (PACK_ELEMENTS + 3,), (2, 3, 5), (5,), (7, 1)], through_a_file, packed)
    packed(opt_b)
    opt_b.state[b[0]]["exp_avg"].mul_(0.5)  # an ordinary tensor: in-place use outside the step works


def test_loaded_norms_become_fp32_on_the_params_device():
    """As Apex's load_state_dict moves the running norms to the parameters' device; they also come back
    as the fp32 tensors the update takes (here from a checkpoint whose norms were stored in fp64)."""
    a = [torch.nn.Parameter(torch.randn(s)) for s in ((5,), (3, 4))]
    opt_a = FusedNovoGrad(a, lr=1e-2)
    for p in a:
        p.grad = torch.randn(p.shape)
    opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    saved["param_groups"][0]["exp_avg_sq"] = [n.double() for n in saved["param_groups"][0]["exp_avg_sq"]]
    b = [torch.nn.Parameter(x.detach().clone()) for x in a]
    opt_b = FusedNovoGrad(b, lr=1e-2)
    opt_b.load_state_dict(saved)
    norms = opt_b.param_groups[0]["exp_avg_sq"]
    assert all(n.dtype == torch.float32 and n.device == b[0].device for n in norms)
    for pa, pb in zip(a, b):
        pa.grad = torch.randn(pa.shape)
        pb.grad = pa.grad.clone()
    opt_a.step()
    opt_b.step()
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_grad_scaler_inf_step_changes_nothing(backend_name):
    params = [torch.nn.Parameter(torch.randn(s)) for s in (3, 4097)]
    opt = FusedNovoGrad(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(torch.ones(()))
    for p in params:
        p.grad = torch.randn_like(p) * 256
    scaler.step(opt)
    scaler.update()
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    for p in params:
        p.grad = torch.randn_like(p)
    params[0].grad[1] = float("nan")
    scaler.step(opt)
    scaler.update()
    for p, q in zip(params, before[0]):
        assert torch.equal(p.detach(), q)
    assert torch.equal(opt.param_groups[0]["exp_avg_sq"][1], before[1]["param_groups"][0]["exp_avg_sq"][1])
    assert opt.param_groups[0]["step"] == 1


def test_triton_launches_are_constant_and_in_bounds(triton_device):
    def launches(n):
        params = [torch.nn.Parameter(torch.randn(3 + 11 * i)) for i in range(n)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = FusedNovoGrad(params, lr=1e-2, init_zero=True)
        with apex.backend("triton"):
            opt.step()
            with TritonTrace(bounds=True) as tr:
                tr.watch(params, [p.grad for p in params], [st["exp_avg"] for st in opt.state.values()],
                         opt.param_groups[0]["exp_avg_sq"])
                opt.step()
        return tr.launches, dict(tr.kernels)

    few, kernels = launches(3)
    many, _ = launches(30)
    # Norm partials, per-tensor blend, update: three launches for any number of parameters.
    assert few == many == 3, kernels


def test_changing_set_of_gradients_is_an_error():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(2)]
    opt = FusedNovoGrad(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    params[1].grad = None
    with pytest.raises(RuntimeError, match="running norms"):
        opt.step()
    assert opt.param_groups[0]["step"] == 1 and torch.equal(params[0].detach(), before[0])


@pytest.mark.parametrize("kwargs, exc, word", [
    ({"amsgrad": True}, RuntimeError, "AMSGrad"),
    ({"lr": -1.0}, ValueError, "lr"),
    ({"eps": -1.0}, ValueError, "eps"),
    ({"betas": (0.9, 1.0)}, ValueError, "betas"),
    ({"norm_type": 1}, ValueError, "norm_type"),
])
def test_bad_constructor_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        FusedNovoGrad([torch.nn.Parameter(torch.randn(3))], **kwargs)


@pytest.mark.parametrize("bad", ["sparse", "dtype"])
def test_bad_gradients_change_nothing(backend_name, bad):
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = FusedNovoGrad(params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    before = [p.detach().clone() for p in params], opt.param_groups[0]["exp_avg_sq"][1].clone()
    params[0].grad = torch.randn(4)
    if bad == "sparse":
        params[1].grad = torch.randn(4).to_sparse()
    else:
        set_grad_of_another_dtype(params[1], torch.randn(4, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError):
        opt.step()
    assert all(torch.equal(p.detach(), q) for p, q in zip(params, before[0]))
    assert torch.equal(opt.param_groups[0]["exp_avg_sq"][1], before[1]) and opt.param_groups[0]["step"] == 1


def test_new_gradients_cost_one_device_table_per_step(triton_device):
    """With new gradient tensors at every step, the norm blend and the update read one table with the new
    addresses: a table per launch costs its own upload."""
    params = [torch.nn.Parameter(torch.randn(5 + i)) for i in range(6)]
    opt = FusedNovoGrad(params, lr=1e-2, weight_decay=0.01)
    with apex.backend("triton"):
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            if step == 2:
                twin = copy.deepcopy(opt)
                twin_params = twin.param_groups[0]["params"]
                for p, q in zip(params, twin_params):
                    q.grad = p.grad.clone()
                twin._plans = {}
                with counting_tables() as built:
                    opt.step()
            else:
                opt.step()
        twin.step()
    assert len(built) == 1, built
    for p, q in zip(params, twin_params):
        assert torch.equal(p.detach(), q.detach())
