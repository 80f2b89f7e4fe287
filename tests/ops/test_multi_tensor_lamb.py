"""amp_C's LAMB ops (Apex's call signatures, through multi_tensor_applier) against a float64 reference."""

from __future__ import annotations

import math

import amp_C
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex.multi_tensor_apply import multi_tensor_applier
from apex.testing import TritonTrace, assert_rel_close

SIZES = [1, 7, 4097, 0, 70000]


def _lists(dtypes=(torch.float32,) * 4, sizes=SIZES, seed=0):
    gen = torch.Generator().manual_seed(seed)
    g = [torch.randn(n, generator=gen).to(dtypes[0]) for n in sizes]
    p = [torch.randn(n, generator=gen).to(dtypes[1]) for n in sizes]
    m = [(torch.randn(n, generator=gen) * 0.1).to(dtypes[2]) for n in sizes]
    v = [(torch.rand(n, generator=gen) * 0.1).to(dtypes[3]) for n in sizes]
    return [g, p, m, v]


def _ref(lists, *, lr, beta1, beta2, eps, step, bias_correction, wd, grad_averaging, mode, gnorm, max_norm,
         nvlamb, inv_scale=1.0):
    g, p, m, v = [[t.double() for t in lst] for lst in lists]
    clip = gnorm / max_norm if gnorm > max_norm else 1.0
    b3 = 1 - beta1 if grad_averaging else 1.0
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = 1 - beta2 ** step if bias_correction else 1.0
    out = []
    for gi, pi, mi, vi in zip(g, p, m, v):
        sg = gi * inv_scale / clip
        if mode == 0:
            sg = sg + wd * pi
        mi = beta1 * mi + b3 * sg
        vi = beta2 * vi + (1 - beta2) * sg * sg
        u = (mi / bc1) / ((vi / bc2).sqrt() + eps)
        if mode == 1:
            u = u + wd * pi
        ratio = lr
        if (wd != 0 or nvlamb) and pi.numel():
            pn, un = float(pi.norm()), float(u.norm())
            ratio = lr * pn / un if pn and un else lr
        out.append((pi - ratio * u, mi, vi))
    return out


def _global_norm(g) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in g))


CASES = [
    dict(mode=1, wd=0.01, nvlamb=False, bias_correction=1, grad_averaging=1, max_norm=1.0),
    dict(mode=0, wd=0.01, nvlamb=False, bias_correction=0, grad_averaging=0, max_norm=1.0),
    dict(mode=1, wd=0.0, nvlamb=False, bias_correction=1, grad_averaging=1, max_norm=1e3),
    dict(mode=1, wd=0.0, nvlamb=True, bias_correction=1, grad_averaging=0, max_norm=1.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_multi_tensor_lamb_fp32(backend_name, case):
    lists = _lists()
    ref = _ref(lists, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=3, gnorm=_global_norm(lists[0]), **case)
    grads = [t.clone() for t in lists[0]]
    noop = torch.zeros(1, dtype=torch.int32)
    gn = torch.tensor([_global_norm(lists[0])], dtype=torch.float32)
    with TritonTrace(bounds=True) as tr:
        tr.watch(lists)
        multi_tensor_applier(amp_C.multi_tensor_lamb, noop, lists, 1e-2, 0.9, 0.999, 1e-6, 3,
                             case["bias_correction"], case["wd"], case["grad_averaging"], case["mode"], gn,
                             case["max_norm"], case["nvlamb"])
    for i, (p_r, m_r, v_r) in enumerate(ref):
        if SIZES[i] == 0:
            continue
        assert_rel_close(lists[1][i], p_r, tol=1e-6, name=f"p{i}")
        assert_rel_close(lists[2][i], m_r, tol=1e-6, name=f"m{i}")
        assert_rel_close(lists[3][i], v_r, tol=1e-6, name=f"v{i}")
    if backend_name == "triton":
        assert all(torch.equal(a, b) for a, b in zip(grads, lists[0])), "gradients must not be modified"
    assert noop.item() == 0
    if backend_name == "triton":
        assert tr.launches == (3 if case["wd"] or case["nvlamb"] else 1)


def test_multi_tensor_lamb_fp16_lists(backend_name):
    lists = _lists((torch.float16,) * 4, sizes=[3, 4097])
    gnorm = _global_norm(lists[0])
    ref = _ref(lists, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=2, bias_correction=1, wd=0.01,
               grad_averaging=1, mode=1, gnorm=gnorm, max_norm=1.0, nvlamb=False)
    noop = torch.zeros(1, dtype=torch.int32)
    amp_C.multi_tensor_lamb(2048, noop, lists, 1e-2, 0.9, 0.999, 1e-6, 2, 1, 0.01, 1, 1,
                            torch.tensor([gnorm]), 1.0, False)
    for i, (p_r, _, _) in enumerate(ref):
        assert_rel_close(lists[1][i], p_r, torch.float16)


@pytest.mark.parametrize("masters", [False, True], ids=["fp32", "bf16_with_masters"])
def test_multi_tensor_lamb_mp(backend_name, masters):
    sizes = [5, 4097]
    if masters:
        lists = _lists((torch.bfloat16, torch.float32, torch.float32, torch.float32), sizes=sizes)
        lists.append([p.bfloat16() for p in lists[1]])
    else:
        lists = _lists(sizes=sizes)
    scale = 8.0
    gnorm = _global_norm(lists[0])
    ref = _ref(lists[:4], lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=4, bias_correction=1, wd=0.01,
               grad_averaging=1, mode=1, gnorm=gnorm, max_norm=scale * 1.0, nvlamb=False, inv_scale=1 / scale)
    noop = torch.zeros(1, dtype=torch.int32)
    with TritonTrace(bounds=True) as tr:
        tr.watch(lists)
        amp_C.multi_tensor_lamb_mp(2048, noop, lists, torch.tensor(1e-2), 0.9, 0.999, 1e-6,
                                   torch.tensor([4], dtype=torch.int32), 1, 0.01, 1, 1, torch.tensor([gnorm]),
                                   torch.tensor([scale]), False, torch.zeros(1), torch.tensor([1 / scale]))
    for i, (p_r, m_r, _) in enumerate(ref):
        assert_rel_close(lists[1][i], p_r, tol=1e-6)
        assert_rel_close(lists[2][i], m_r, tol=1e-6)
        if masters:  # the model copy is the master rounded once (the interpreter truncates: one ulp)
            exact = lists[1][i].bfloat16().float()
            assert torch.allclose(lists[4][i].float(), exact, rtol=2.0 ** -7, atol=0)


def test_multi_tensor_lamb_mp_skips_when_flagged(backend_name):
    lists = _lists(sizes=[5, 4097])
    lists.append([p.half() for p in lists[1]])
    before = [[t.clone() for t in lst] for lst in lists]
    noop = torch.ones(1, dtype=torch.int32)
    amp_C.multi_tensor_lamb_mp(2048, noop, lists, torch.tensor(1e-2), 0.9, 0.999, 1e-6,
                               torch.tensor([1], dtype=torch.int32), 1, 0.01, 1, 1, torch.tensor([1.0]),
                               torch.tensor([1.0]), False, torch.ones(1), torch.tensor([1.0]))
    for lst, old in zip(lists, before):
        assert all(torch.equal(a, b) for a, b in zip(lst, old))


def test_stage1_and_stage2(backend_name):
    g, p, m, v = _lists(sizes=[3, 4097, 70000])
    upd = [torch.empty_like(t) for t in p]
    decay = torch.tensor([0.0, 0.01, 0.1])
    gnorm = _global_norm(g)
    ref_m = [0.9 * mi.double() + 0.1 * gi.double() / (gnorm / 2.0) for mi, gi in zip(m, g)]
    ref_v = [0.999 * vi.double() + 0.001 * (gi.double() / (gnorm / 2.0)) ** 2 for vi, gi in zip(v, g)]
    ref_u = [(mi / (1 - 0.9 ** 6)) / ((vi / (1 - 0.999 ** 6)).sqrt() + 1e-6) + d * pi.double()
             for mi, vi, d, pi in zip(ref_m, ref_v, decay.tolist(), p)]
    p0 = [t.double() for t in p]
    noop = torch.zeros(1, dtype=torch.int32)
    with TritonTrace(bounds=True) as tr:
        tr.watch(g, p, m, v, upd)
        amp_C.multi_tensor_lamb_stage1_cuda(2048, noop, [g, p, m, v, upd], decay, 5, 0.9, 0.999, 1e-6,
                                            torch.tensor([gnorm]), 2.0)
        for a, r in zip(upd, ref_u):
            assert_rel_close(a, r, tol=1e-6, name="update")
        assert_rel_close(torch.cat(m), torch.cat(ref_m), tol=1e-6, name="m")
        pn = torch.stack([t.norm() for t in p])
        un = torch.stack([t.norm() for t in upd])
        amp_C.multi_tensor_lamb_stage2_cuda(2048, noop, [p, upd], pn, un, 1e-2, 0.01, False)
    for pi, p0i, ui, a, b in zip(p, p0, ref_u, pn.tolist(), un.tolist()):
        assert_rel_close(pi, p0i - 1e-2 * (a / b) * ui, tol=1e-6)


def test_bad_arguments():
    lists = _lists(sizes=[3, 5])
    noop = torch.zeros(1, dtype=torch.int32)
    gn = torch.ones(1)
    args = (1e-2, 0.9, 0.999, 1e-6, 1, 1, 0.0, 1, 1, gn, 1.0, False)
    with pytest.raises(ValueError, match="4"):
        amp_C.multi_tensor_lamb(2048, noop, lists[:3], *args)
    with pytest.raises(ValueError, match="noop_flag"):
        amp_C.multi_tensor_lamb(2048, torch.zeros(1), lists, *args)
    with pytest.raises(ValueError, match="shape"):
        amp_C.multi_tensor_lamb(2048, noop, [lists[0], lists[1][::-1], lists[2], lists[3]], *args)
    with pytest.raises(TypeError, match="global_grad_norm"):
        amp_C.multi_tensor_lamb(2048, noop, lists, *args[:9], 1.0, 1.0, False)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=6), wd=st.sampled_from([0.0, 0.05]),
       mode=st.sampled_from([0, 1]), step=st.integers(1, 50), scale=st.floats(0.01, 100.0))
def test_multi_tensor_lamb_random_lists(backend_name, sizes, wd, mode, step, scale):
    lists = _lists(sizes=sizes, seed=len(sizes) + step)
    for t in lists[0]:
        t.mul_(scale)
    gnorm = _global_norm(lists[0])
    ref = _ref(lists, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=step, bias_correction=1, wd=wd,
               grad_averaging=1, mode=mode, gnorm=gnorm, max_norm=1.0, nvlamb=False)
    with TritonTrace(bounds=True) as tr:
        tr.watch(lists)
        amp_C.multi_tensor_lamb(2048, torch.zeros(1, dtype=torch.int32), lists, 1e-2, 0.9, 0.999, 1e-6, step, 1,
                                wd, 1, mode, torch.tensor([gnorm]), 1.0, False)
    for i, (p_r, _, v_r) in enumerate(ref):
        if sizes[i]:
            assert_rel_close(lists[1][i], p_r, tol=1e-6, name=f"p{i}")
            assert_rel_close(lists[3][i], v_r, tol=1e-6, name=f"v{i}")


@settings(max_examples=15, deadline=None)
@given(shapes=st.lists(st.sampled_from([(0,), (1,), (5,), (3, 5), (15,), (64,), (8, 8), (700,)]), min_size=1,
                       max_size=12),
       block=st.sampled_from([1, 100, 1000, 1 << 18]), wd=st.sampled_from([0.0, 0.01]), nvlamb=st.booleans())
def test_cpu_workspace_layout_matches_float64(shapes, block, wd, nvlamb):
    """The fused CPU path's workspace (blocks of tensors ordered by size, runs of same-sized tensors normed
    as one 2-D view) on lists with repeated sizes and shapes, cut into blocks of any size."""
    import apex
    from apex.ops import _cpu_blocks

    saved = _cpu_blocks.BLOCK_ELEMENTS
    gen = torch.Generator().manual_seed(len(shapes) + block)
    lists = [[torch.randn(s, generator=gen) * (0.1 if k >= 2 else 1.0) for s in shapes] for k in range(4)]
    lists[3] = [v.abs() for v in lists[3]]
    gnorm = _global_norm(lists[0])
    ref = _ref(lists, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=3, bias_correction=1, wd=wd,
               grad_averaging=1, mode=1, gnorm=gnorm, max_norm=1.0, nvlamb=nvlamb)
    try:
        _cpu_blocks.BLOCK_ELEMENTS = block
        with apex.backend("torch"):
            amp_C.multi_tensor_lamb(2048, torch.zeros(1, dtype=torch.int32), lists, 1e-2, 0.9, 0.999, 1e-6, 3, 1,
                                    wd, 1, 1, torch.tensor([gnorm]), 1.0, nvlamb)
    finally:
        _cpu_blocks.BLOCK_ELEMENTS = saved
    assert [tuple(t.shape) for t in lists[1]] == shapes

    def flat(ts):  # one relative error per list: a one-element moment can cancel to nearly zero
        return torch.cat([t.reshape(-1) for t in ts])

    for k, name in ((1, "params"), (2, "exp_avg"), (3, "exp_avg_sq")):
        assert_rel_close(flat(lists[k]), flat([r[k - 1] for r in ref]), tol=1e-6, name=name)
