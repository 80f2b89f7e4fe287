"""amp_C.multi_tensor_novograd (Apex's call signature) against a float64 reference."""

from __future__ import annotations

import math

import amp_C
import pytest
import torch

from apex.multi_tensor_apply import multi_tensor_applier
from apex.testing import TritonTrace, assert_rel_close

SIZES = [1, 7, 4097, 70000]


def _ref(g, p, m, norms, *, lr, beta1, beta2, eps, step, bias_correction, wd, grad_averaging, moment_mode,
         norm_type):
    b3 = 1 - beta1 if grad_averaging else 1.0
    bc1 = 1 - beta1 ** step if bias_correction else 1.0
    bc2 = math.sqrt(1 - beta2 ** step) if bias_correction else 1.0
    out = []
    for gi, pi, mi, old in zip(g, p, m, norms.tolist()):
        gi, pi, mi = gi.double(), pi.double(), mi.double()
        if norm_type == 0:
            n = beta2 * old + (1 - beta2) * float(gi.abs().max())
        else:
            n = math.sqrt(beta2 * old * old + (1 - beta2) * float(gi.norm()) ** 2)
        d = n / bc2 + eps
        if moment_mode == 0:
            mi = beta1 * mi + b3 * (gi / d + wd * pi)
            pi = pi - lr * mi / bc1
        else:
            mi = beta1 * mi + b3 * gi
            pi = pi - lr * ((mi / bc1) / d + wd * pi)
        out.append((pi, mi, n))
    return out


CASES = [dict(moment_mode=1, norm_type=2, wd=0.0, bias_correction=1, grad_averaging=1),
         dict(moment_mode=0, norm_type=2, wd=0.01, bias_correction=1, grad_averaging=0),
         dict(moment_mode=1, norm_type=0, wd=0.01, bias_correction=0, grad_averaging=1),
         dict(moment_mode=0, norm_type=0, wd=0.0, bias_correction=1, grad_averaging=1)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_multi_tensor_novograd(backend_name, case, dtype):
    gen = torch.Generator().manual_seed(0)
    g = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    p = [torch.randn(n, generator=gen).to(dtype) for n in SIZES]
    m = [(torch.randn(n, generator=gen) * 0.1).to(dtype) for n in SIZES]
    norms = torch.rand(len(SIZES), generator=gen) + 0.5
    ref = _ref(g, p, m, norms, lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, step=4, **case)
    grads = [t.clone() for t in g]
    noop = torch.zeros(1, dtype=torch.int32)
    with TritonTrace(bounds=True) as tr:
        tr.watch(g, p, m, norms)
        multi_tensor_applier(amp_C.multi_tensor_novograd, noop, [g, p, m], norms, 1e-2, 0.95, 0.98, 1e-8, 4,
                             case["bias_correction"], case["wd"], case["grad_averaging"], case["moment_mode"],
                             case["norm_type"])
    tol = 1e-6 if dtype == torch.float32 else None
    for i, (p_r, _, n_r) in enumerate(ref):
        assert_rel_close(p[i], p_r, dtype, tol=tol, name=f"p{i}")
        n_ref = torch.tensor([n_r], dtype=torch.float64)
        assert_rel_close(norms[i:i + 1], n_ref, torch.float32, name=f"norm{i}")
    assert_rel_close(torch.cat(m), torch.cat([r[1] for r in ref]), dtype, tol=tol, name="m")
    assert all(torch.equal(a, b) for a, b in zip(g, grads)) and noop.item() == 0
    if backend_name == "triton":
        assert tr.launches == 3


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("packed_moments", [False, True], ids=["own-moments", "packed-moments"])
@pytest.mark.parametrize("segment", [1 << 20, 5000], ids=["one-segment", "segments"])
def test_cpu_workspace_paths_match_float64(monkeypatch, case, packed_moments, segment):
    """With a workspace (as FusedNovoGrad passes it), fp32 lists take the packed path: small gradients
    copied into a flat buffer and normed a class at a time, and, when the moments are the workspace's
    views, one moment update for all the small tensors; the others normed and updated a segment at a
    time. Two same-sized tensors make a class."""
    from apex.ops import _cpu_packed
    from apex.ops._cpu_blocks import Workspace
    from apex.ops.multi_tensor_novograd import multi_tensor_novograd

    monkeypatch.setattr(_cpu_packed, "SEGMENT_ELEMENTS", segment)

    sizes = [7, 4097, 1, 7, 70000, 300, 5001, 4100]
    gen = torch.Generator().manual_seed(5)
    g = [torch.randn(n, generator=gen) for n in sizes]
    p = [torch.randn(n, generator=gen) for n in sizes]
    m = [torch.randn(n, generator=gen) * 0.1 for n in sizes]
    norms = torch.rand(len(sizes), generator=gen) + 0.5
    ref = _ref(g, p, m, norms, lr=1e-2, beta1=0.95, beta2=0.98, eps=1e-8, step=4, **case)
    ws = Workspace.of(p)
    assert len(ws.packed().segments) == (2 if segment > 1e5 else 5)
    noop = torch.zeros(1, dtype=torch.int32)
    for _ in range(2):  # the second call reuses the workspace's buffers
        args = [t.clone() for t in p], [t.clone() for t in m], norms.clone()
        ps, ms, ns = args
        if packed_moments:
            ms = ws.packed().adopt("exp_avg", ms)
            assert ws.packed().holds("exp_avg", [ms[i] for i in ws.packed().index])
        multi_tensor_novograd(2048, noop, [g, ps, ms], ns, 1e-2, 0.95, 0.98, 1e-8, 4, case["bias_correction"],
                              case["wd"], case["grad_averaging"], case["moment_mode"], case["norm_type"],
                              workspace=ws)
        for i, (p_r, m_r, _) in enumerate(ref):
            assert_rel_close(ps[i], p_r, tol=1e-6, name=f"p{i}")
            assert_rel_close(ms[i], m_r, tol=1e-6, name=f"m{i}")
        assert_rel_close(ns, torch.tensor([r[2] for r in ref], dtype=torch.float64), tol=1e-6, name="norms")
        assert not any(t.is_inference() for t in (*ps, *ms, ns))


def test_non_finite_gradient_sets_the_flag(backend_name):
    g = [torch.randn(5), torch.randn(9)]
    g[1][3] = float("inf")
    noop = torch.zeros(1, dtype=torch.int32)
    amp_C.multi_tensor_novograd(2048, noop, [g, [torch.randn(5), torch.randn(9)], [torch.zeros(5),
                                torch.zeros(9)]], torch.ones(2), 1e-2, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 1, 2)
    assert noop.item() == 1


def test_mixed_dtypes_and_empty_tensors(backend_name):
    g = [torch.randn(5), torch.randn(0), torch.randn(6).half()]
    p = [torch.randn(5), torch.randn(0), torch.randn(6).half()]
    m = [torch.zeros(5), torch.zeros(0), torch.zeros(6).half()]
    norms = torch.tensor([1.0, 2.0, 3.0])
    amp_C.multi_tensor_novograd(2048, torch.zeros(1, dtype=torch.int32), [g, p, m], norms, 1e-2, 0.9, 0.5,
                                1e-8, 1, 1, 0.0, 1, 1, 2)
    expected = [math.sqrt(0.5 + 0.5 * float(g[0].norm()) ** 2), math.sqrt(0.5 * 4.0),
                math.sqrt(0.5 * 9 + 0.5 * float(g[2].float().norm()) ** 2)]
    assert_rel_close(norms, torch.tensor(expected, dtype=torch.float64), tol=1e-6)


def test_bad_arguments():
    g, p, m = [torch.randn(3)], [torch.randn(3)], [torch.zeros(3)]
    noop = torch.zeros(1, dtype=torch.int32)
    args = (1e-2, 0.9, 0.99, 1e-8, 1, 1, 0.0, 1, 1)
    with pytest.raises(ValueError, match="norm_type"):
        amp_C.multi_tensor_novograd(2048, noop, [g, p, m], torch.ones(1), *args, 1)
    with pytest.raises(ValueError, match="grad_norms"):
        amp_C.multi_tensor_novograd(2048, noop, [g, p, m], torch.ones(2), *args, 2)
    with pytest.raises(ValueError, match="3"):
        amp_C.multi_tensor_novograd(2048, noop, [g, p], torch.ones(1), *args, 2)
