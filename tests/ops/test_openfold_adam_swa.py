"""apex.contrib.openfold_triton.fused_adam_swa (apex.ops.openfold_adam_swa): several steps of Adam + bf16 copy
+ SWA against a float64 reference on both backends (the Triton path under the interpreter)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from apex.contrib.openfold_triton.fused_adam_swa import AdamMathType, FusedAdamSWA
from apex.testing import assert_rel_close


# ---------------------------------------------------------------------------------------- FusedAdamSWA
def _ref_adam_swa(p, g, m, v, steps, lr, b1, b2, eps, wd, decay, mode, clip, n_avg0, swa, bias_correction=True):
    """float64 Adam (per AdamMathType) + exponential SWA, element by element as the docstring states."""
    p, m, v, swa = p.clone(), m.clone(), v.clone(), swa.clone()
    n_avg = n_avg0
    for t, gt in zip(steps, g):
        gt = gt * clip
        bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
        if mode != AdamMathType.ApexAdamW:
            gt = gt + wd * p
        m = b1 * m + (1 - b1) * gt
        v = b2 * v + (1 - b2) * gt * gt
        if mode == AdamMathType.PyTorchAdam:
            p = p - (lr / bc1) * m / (v.sqrt() / math.sqrt(bc2) + eps)
        else:
            upd = (m / bc1) / ((v / bc2).sqrt() + eps)
            if mode == AdamMathType.ApexAdamW:
                upd = upd + wd * p
            p = p - lr * upd
        swa = p.clone() if n_avg == 0 else swa + (1 - decay) * (p - swa)
        n_avg += 1
    return p, m, v, swa


@pytest.mark.parametrize("bias_correction", [True, False], ids=["bc", "no_bc"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("mode", list(AdamMathType), ids=lambda m: m.name)
def test_fused_adam_swa_several_steps_match_float64(backend_name, mode, state_dtype, bias_correction):
    sizes = [1, 37, 130, 257]
    compute_dtypes = [torch.bfloat16, state_dtype, torch.float16, torch.float32]
    params = [torch.nn.Parameter(torch.randn(s, dtype=state_dtype)) for s in sizes]
    compute = [p.detach().to(d) for p, d in zip(params, compute_dtypes)]
    swa = [p.detach().clone() for p in params]
    init = [p.detach().double().clone() for p in params]
    hp = dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-6, weight_decay=1e-2)
    opt = FusedAdamSWA(params, compute, swa, swa_decay_rate=0.9, adam_math_mode=mode,
                       bias_correction=bias_correction, **hp)
    n_steps, clip = 4, 0.5
    grads = [[torch.randn(s).to(d) for s, d in zip(sizes, compute_dtypes)] for _ in range(n_steps)]
    for step in range(n_steps):
        for c, g in zip(compute, grads[step]):
            c.grad = g.clone()
        opt.step(grad_clip_scale=clip if step % 2 else torch.tensor(clip))
        opt.zero_grad()
    assert opt.swa_param_groups[0]["n_averaged"] == n_steps and opt.param_groups[0]["step"] == n_steps
    tol = 1e-12 if state_dtype == torch.float64 else 1e-5
    for i in range(len(sizes)):
        rp, rm, rv, rs = _ref_adam_swa(init[i], [gs[i].double() for gs in grads], torch.zeros_like(init[i]),
                                       torch.zeros_like(init[i]), range(1, n_steps + 1), hp["lr"], *hp["betas"],
                                       hp["eps"], hp["weight_decay"], 0.9, mode, clip, 0, init[i].clone(),
                                       bias_correction)
        st = opt.state[params[i]]
        for name, got, ref in [("param", params[i], rp), ("swa", swa[i], rs), ("exp_avg", st["exp_avg"], rm),
                               ("exp_avg_sq", st["exp_avg_sq"], rv)]:
            assert got.dtype == state_dtype
            assert_rel_close(got, ref, tol=tol, name=f"{name}[{i}]")
        # The compute copy is the updated parameter rounded once to its dtype.
        assert torch.equal(compute[i], params[i].detach().to(compute_dtypes[i]))


def test_fused_adam_swa_from_optim_continues_torch_adam(backend_name):
    model = torch.nn.Linear(7, 5)
    adam = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(2):
        model(torch.randn(3, 7)).square().sum().backward()
        adam.step()
        adam.zero_grad()
    params = list(model.parameters())
    compute = [p.detach().clone() for p in params]
    swa = [p.detach().clone() for p in params]
    fused = FusedAdamSWA.from_optim(adam, params, compute, swa, swa_decay_rate=0.5)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    adam2 = torch.optim.Adam(twin, lr=1e-2, weight_decay=1e-3)
    adam2.load_state_dict(copy.deepcopy(adam.state_dict()))
    for _ in range(2):
        gs = [torch.randn(p.shape) for p in params]
        for c, t, g in zip(compute, twin, gs):
            c.grad, t.grad = g.clone(), g.clone()
        fused.step()
        adam2.step()
    for p, t in zip(params, twin):
        assert_rel_close(p, t, tol=1e-6)
    for p in params:  # the source optimizer's state was copied, not shared
        assert fused.state[p]["exp_avg"].data_ptr() != adam.state[p]["exp_avg"].data_ptr()
    assert fused.param_groups[0]["step"] == 4


def test_fused_adam_swa_params_without_grad_are_averaged_not_updated():
    p = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(6))]
    c = [x.detach().clone() for x in p]
    s = [torch.zeros(5), torch.zeros(6)]
    opt = FusedAdamSWA(p, c, s, swa_decay_rate=0.5)
    c[0].grad = torch.randn(5)
    before = p[1].detach().clone()
    opt.step()
    assert torch.equal(p[1].detach(), before) and torch.equal(s[1], before)  # first average copies
    assert not torch.equal(p[0].detach(), c[0].grad)


@pytest.mark.no_triton_launch("refused before any launch")
@pytest.mark.parametrize("which", [0, 1, 3, 5])
def test_adam_swa_step_refuses_tensors_on_another_device(triton_device, which):
    """The Triton path's kernels read every list's tensors next to the gradients: one on another device
    (``meta`` standing in) is refused, naming it, before a kernel runs; the others keep their values."""
    import apex
    from apex.ops.openfold_adam_swa import adam_swa_step

    lists = [[torch.randn(5, device=triton_device)] for _ in range(6)]
    lists[which] = [lists[which][0].to("meta")]
    before = [lst[0].clone() for i, lst in enumerate(lists) if i != which]
    with apex.backend("triton"), pytest.raises(ValueError, match=r"adam_swa_step's lists\[\d\]\[0\] is on .*meta"):
        adam_swa_step(*lists, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bias_correction1=0.1,
                      bias_correction2=0.001, swa_decay_rate=0.9, first_average=False, mode=0)
    assert all(torch.equal(a, lst[0]) for a, lst in zip(before, [x for i, x in enumerate(lists) if i != which]))


def test_fused_adam_swa_bad_arguments_change_nothing():
    p = [torch.nn.Parameter(torch.randn(5))]
    c = [p[0].detach().clone()]
    with pytest.raises(ValueError, match="equal lengths"):
        FusedAdamSWA(p, c + c, [p[0].detach().clone()], 0.9)
    with pytest.raises(ValueError, match="shapes differ"):
        FusedAdamSWA(p, [torch.randn(4)], [torch.randn(5)], 0.9)
    with pytest.raises(NotImplementedError):
        FusedAdamSWA(p, c, [torch.randn(5)], 0.9, amsgrad=True)
    with pytest.raises(ValueError, match="adam_math_mode"):
        FusedAdamSWA(p, c, [torch.randn(5)], 0.9, adam_math_mode=2)
    opt = FusedAdamSWA(p, c, [torch.randn(5)], 0.9)
    c[0].grad = torch.randn(5).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert "step" not in opt.param_groups[0] and opt.swa_param_groups[0]["n_averaged"] == 0
    assert torch.equal(p[0].detach(), c[0].detach())
    opt.param_groups.append(dict(opt.param_groups[0], params=[]))
    before = p[0].detach().clone()
    c[0].grad = torch.randn(5)
    with pytest.raises(RuntimeError, match="multiple param groups"):
        opt.step()
    assert torch.equal(p[0].detach(), before)
