import math

import pytest
import torch

from apex.contrib.optimizers import FusedAdam, FusedSGD
from apex.ops import legacy_adam
from apex.testing import assert_rel_close


def _ref_adam(p, m, v, g, lr, b1, b2, eps, scale, step, mode, bc, decay):
    """float64 reference of Apex's legacy Adam formula."""
    p, m, v, g = (t.double() for t in (p, m, v, g))
    g = g / scale
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = torch.sqrt(v + eps) if mode == 0 else torch.sqrt(v) + eps
    ss = lr * math.sqrt(1 - b2 ** step) / (1 - b1 ** step) if bc else lr
    return p - ss * (m / denom + decay * p), m, v


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("bc", [0, 1])
@pytest.mark.parametrize("gdtype", [torch.float32, torch.float16, torch.bfloat16])
def test_legacy_adam_op_matches_the_float64_formula(mode, bc, gdtype):
    torch.manual_seed(0)
    p = torch.randn(37, 5)
    m, v = torch.randn(37, 5) * 0.1, torch.rand(37, 5) * 0.01
    g = (torch.randn(37, 5) * 64).to(gdtype)
    copy = torch.empty(37, 5, dtype=torch.float16)
    ref = _ref_adam(p, m, v, g, 1e-2, 0.9, 0.99, 1e-6, 64.0, 3, mode, bc, 0.01)
    legacy_adam.adam(p, copy, m, v, g, 1e-2, 0.9, 0.99, 1e-6, 64.0, 3, mode, bc, 0.01)
    for got, want in zip((p, m, v), ref):
        assert_rel_close(got, want, 1e-6)
    assert torch.equal(copy, p.half())


def test_legacy_adam_op_on_non_contiguous_tensors_and_bad_sizes():
    base = torch.randn(8, 6)
    p = base.t()  # non-contiguous view, updated in place
    m, v, g = torch.zeros(6, 8), torch.zeros(6, 8), torch.randn(8, 6).t()
    ref = _ref_adam(p, m, v, g, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0)
    legacy_adam.adam(p, torch.empty(0), m, v, g, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0)
    assert_rel_close(base.t(), ref[0], 1e-6)
    before = p.clone()
    with pytest.raises(ValueError, match="number of elements in m"):
        legacy_adam.adam(p, torch.empty(0), torch.zeros(5), v, g, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 1, 1, 0.0)
    with pytest.raises(ValueError, match="mode"):
        legacy_adam.adam(p, torch.empty(0), m, v, g, 1e-3, 0.9, 0.999, 1e-8, 1.0, 1, 2, 1, 0.0)
    assert torch.equal(p, before)


def test_reversible_adam_overflow_check_and_undo():
    torch.manual_seed(1)
    p0 = torch.randn(50, dtype=torch.float64)
    m0, v0 = torch.randn(50, dtype=torch.float64) * 0.1, torch.rand(50, dtype=torch.float64) * 0.1
    g = torch.randn(50, dtype=torch.float64)
    g[7] = math.inf
    p, m, v = p0.clone(), m0.clone(), v0.clone()
    copy = torch.zeros(50, dtype=torch.float16)
    args = (1e-2, 0.9, 0.99, 1e-8, 2.0, 4, 1, 1, 0.01)
    legacy_adam.reversible_adam(p, copy, m, v, g, *args)
    assert p[7] == p0[7] and m[7] == m0[7] and v[7] == v0[7]  # the overflowing element is untouched
    assert not torch.equal(p, p0) and math.isinf(copy[0])
    flag = torch.zeros(1, dtype=torch.int32)
    legacy_adam.strided_check_finite(flag, copy[1:], 1, 1)
    assert flag.item() == 0
    legacy_adam.strided_check_finite(flag, copy, 7, 1)
    assert flag.item() == 1
    legacy_adam.strided_check_finite(flag, copy[1:], 1, 0)  # not cleared: stays set
    assert flag.item() == 1
    legacy_adam.maybe_adam_undo(torch.zeros(1, dtype=torch.int32), p, m, v, g, *args)  # flag clear: no-op
    assert not torch.equal(p, p0)
    legacy_adam.maybe_adam_undo(flag, p, m, v, g, *args)
    for got, want in ((p, p0), (m, m0), (v, v0)):
        assert_rel_close(got, want, 1e-12)


def test_maybe_cast_and_e5m2():
    flag = torch.ones(1, dtype=torch.int32)
    src, dst = torch.randn(20), torch.zeros(20, dtype=torch.float16)
    legacy_adam.maybe_cast(flag, src, dst)
    assert not dst.any()
    flag.zero_()
    legacy_adam.maybe_cast_mt(2048, flag, [[src], [dst]])
    assert torch.equal(dst, src.half())
    # e5m2 bytes: decoding and re-encoding every finite byte is the identity
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = (b & 0x7C) != 0x7C
    assert torch.equal(legacy_adam.encode_e5m2(legacy_adam.decode_e5m2(b))[finite], b[finite])
    # Apex rounds to nearest through fp16 (add half an e5m2 ulp, round to fp16, truncate): it agrees with
    # PyTorch's float8_e5m2 except within an fp16 rounding of a midpoint, where it may pick the other neighbour
    x = torch.randn(4000) * 10
    e = torch.zeros(4000, dtype=torch.uint8)
    legacy_adam.maybe_cast(flag, x, e)
    t = x.to(torch.float8_e5m2).view(torch.uint8)
    differ = e != t
    assert differ.float().mean() < 0.02
    assert ((e.int() - t.int()).abs() <= 1).all()
    a, b = legacy_adam.decode_e5m2(e[differ]).double(), t[differ].view(torch.float8_e5m2).double()
    assert ((x[differ].double() - (a + b) / 2).abs() <= x[differ].double().abs() * 2.0 ** -11).all()
    back = torch.zeros(4000)
    legacy_adam.maybe_cast(flag, e, back)
    assert torch.equal(back, legacy_adam.decode_e5m2(e).float())


def test_compat_modules_expose_the_legacy_ops():
    import fused_adam_cuda
    import fused_lamb_cuda

    assert fused_adam_cuda.adam is legacy_adam.adam
    assert set(fused_adam_cuda.__all__) == {"adam", "reversible_adam", "adam_mt", "maybe_adam_undo", "maybe_cast",
                                            "maybe_cast_mt", "strided_check_finite"}
    from apex.ops.legacy_lamb import lamb
    assert fused_lamb_cuda.lamb is lamb


def test_fused_lamb_cuda_is_multi_tensor_lamb_without_nvlamb():
    from apex.ops.legacy_lamb import lamb
    from apex.ops.multi_tensor_lamb import multi_tensor_lamb

    torch.manual_seed(2)
    shapes = [(7, 3), (11,)]
    out = []
    for use_tensor in (False, True):
        torch.manual_seed(3)
        grads = [torch.randn(s) for s in shapes]
        params = [torch.randn(s) for s in shapes]
        ms, vs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
        norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        flag = torch.zeros(1, dtype=torch.int32)
        if use_tensor:
            multi_tensor_lamb(2048, flag, [grads, params, ms, vs], 1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1,
                              norm.reshape(1), 1.0, False)
        else:
            lamb(2048, flag, [grads, params, ms, vs], 1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.01, 1, 1, float(norm), 1.0)
        out.append(params)
    for a, b in zip(*out):
        assert torch.equal(a, b)


def _adam_reference_run(params, grads_per_step, lr, betas, eps, wd, mode, bc):
    ps = [p.double().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for step, grads in enumerate(grads_per_step, 1):
        for i, g in enumerate(grads):
            ps[i], ms[i], vs[i] = _ref_adam(ps[i], ms[i], vs[i], g, lr, *betas, eps, 1.0, step, mode, bc, wd)
    return ps


@pytest.mark.parametrize("use_mt", [False, True])
@pytest.mark.parametrize("eps_inside_sqrt", [False, True])
def test_fused_adam_matches_reference_over_steps(use_mt, eps_inside_sqrt):
    torch.manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(13, 3), (5,), (2, 2, 3)]]
    init = [p.detach().clone() for p in params]
    opt = FusedAdam(params, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05, use_mt=use_mt,
                    eps_inside_sqrt=eps_inside_sqrt)
    all_grads = []
    for _ in range(4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        all_grads.append(grads)
    ref = _adam_reference_run(init, all_grads, 1e-2, (0.8, 0.99), 1e-6, 0.05, 0 if eps_inside_sqrt else 1, 1)
    for p, r in zip(params, ref):
        assert_rel_close(p.detach(), r, 1e-6)


def test_fused_adam_is_torch_adam_when_eps_is_negligible():
    torch.manual_seed(5)
    w = torch.randn(40, dtype=torch.float64)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    opt_a = FusedAdam([a], lr=1e-2, eps=1e-30)
    opt_b = torch.optim.Adam([b], lr=1e-2, eps=1e-30)
    for _ in range(5):
        g = torch.randn(40, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert_rel_close(a.detach(), b.detach(), 1e-12)


@pytest.mark.parametrize("use_mt", [False, True])
def test_fused_adam_old_signature_with_scale_output_params_groups_and_clipping(use_mt):
    torch.manual_seed(6)
    masters = [torch.nn.Parameter(torch.randn(s)) for s in [(9, 4), (6,), (3, 5)]]
    init = [p.detach().clone() for p in masters]
    opt = FusedAdam([{"params": masters[:2]}, {"params": masters[2:], "lr": 5e-3}], lr=1e-2, use_mt=use_mt,
                    max_grad_norm=1.0)
    scale = 128.0
    true_grads = [torch.randn_like(p) * 3 for p in masters]
    half_grads = [(g * scale).half() for g in true_grads]
    outs = [torch.zeros_like(p, dtype=torch.float16) for p in masters]
    norms = [torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in half_grads[:2]])),
             torch.linalg.vector_norm(half_grads[2].float())]
    opt.step(grads=[half_grads[:2], half_grads[2:]], output_params=[outs[:2], outs[2:]], scale=scale,
             grad_norms=norms)
    for i, (p, r0) in enumerate(zip(masters, init)):
        group = 0 if i < 2 else 1
        clip = max(1.0, (float(norms[group]) / scale + 1e-6) / 1.0)
        want = _ref_adam(r0, torch.zeros_like(r0), torch.zeros_like(r0), half_grads[i], 1e-2 if group == 0 else 5e-3,
                         0.9, 0.999, 1e-8, scale * clip, 1, 1, 1, 0.0)[0]
        assert_rel_close(p.detach(), want, 1e-6)
        assert torch.equal(outs[i], p.detach().half())
        assert p.grad is None


def test_fused_adam_bad_arguments():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="betas"):
        FusedAdam([p], betas=(0.9, 1.5))
    opt = FusedAdam([p], max_grad_norm=1.0)
    p.grad = torch.randn(4)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="grad_norms"):
        opt.step()
    with pytest.raises(ValueError, match="elements"):
        FusedAdam([p]).step(grads=[torch.randn(5)])
    assert torch.equal(p.detach(), before) and len(opt.state) == 0


@pytest.mark.parametrize("nesterov,wd_after", [(False, False), (True, False), (False, True)])
def test_contrib_fused_sgd_matches_torch_sgd(nesterov, wd_after):
    torch.manual_seed(7)
    shapes = [(10, 3), (7,)]
    model = [torch.randn(s).half() for s in shapes] + [torch.randn(4, 4)]
    masters = [torch.nn.Parameter(w.float().clone()) for w in model[:2]] + [torch.nn.Parameter(model[2])]
    ref = [torch.nn.Parameter(w.double().clone()) for w in model]
    kw = dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    opt = FusedSGD(masters, wd_after_momentum=wd_after, **kw)
    ref_opt = torch.optim.SGD(ref, **kw)
    scale = 64.0
    for _ in range(3):
        grads = [torch.randn(w.shape) for w in model]
        scaled = [(g * scale).to(w.dtype) for g, w in zip(grads, model)]
        opt.step(grads=scaled, output_params=[model[0], model[1], masters[2]], scale=scale)
        for r, s in zip(ref, scaled):
            r.grad = s.double() / scale
        if wd_after:  # torch.optim.SGD has no weight decay after momentum: the float64 reference by hand
            with torch.no_grad():
                for r in ref:
                    st = ref_opt.state[r]
                    buf = st.get("momentum_buffer")
                    buf = r.grad.clone() if buf is None else buf.mul_(0.9).add_(r.grad)
                    st["momentum_buffer"] = buf
                    r.sub_(0.1 * (buf + 0.01 * r))
        else:
            ref_opt.step()
    for m, r in zip(masters, ref):
        assert_rel_close(m.detach(), r.detach(), 1e-6)
    assert torch.equal(model[0], masters[0].detach().half()) and torch.equal(model[1], masters[1].detach().half())


def test_contrib_fused_sgd_needs_grads_and_output_params():
    p = torch.nn.Parameter(torch.randn(3))
    opt = FusedSGD([p], lr=0.1)
    with pytest.raises(RuntimeError, match="grads"):
        opt.step()
    with pytest.raises(RuntimeError, match="output_params"):
        opt.step(grads=[torch.randn(3)])
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD([p], lr=0.1, nesterov=True)
