"""apex.contrib.layer_norm: FastLayerNorm, FastLayerNormFN, _fast_layer_norm and ``fast_layer_norm``."""

import pytest
import torch
import torch.nn.functional as F

from apex.testing import assert_rel_close


def _ref(x, gamma, beta, eps, dz):
    leaves = [t.detach().double().requires_grad_() for t in (x, gamma, beta)]
    z = F.layer_norm(leaves[0], leaves[1].shape, leaves[1], leaves[2], eps)
    return z.detach(), torch.autograd.grad(z, leaves, dz.double())


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("itype,wtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                         (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)],
                         ids=str)
def test_fast_layer_norm_fn(backend_name, itype, wtype, mem_eff):
    from apex.contrib.layer_norm.layer_norm import FastLayerNormFN

    h = 200
    x = torch.randn(3, 7, h).to(itype).requires_grad_()
    gamma = (1 + 0.2 * torch.randn(h)).to(wtype).requires_grad_()
    beta = (0.2 * torch.randn(h)).to(wtype).requires_grad_()
    z = FastLayerNormFN.apply(x, gamma, beta, 1e-5, mem_eff)
    assert z.dtype == wtype and z.shape == x.shape  # Apex: the output has gamma's dtype
    dz = torch.randn(z.shape).to(wtype)
    grads = torch.autograd.grad(z, [x, gamma, beta], dz)
    assert [g.dtype for g in grads] == [itype, wtype, wtype]
    ref_z, ref_g = _ref(x, gamma, beta, 1e-5, dz)
    low = torch.float32 if wtype == torch.float32 and itype == torch.float32 else (
        torch.bfloat16 if torch.bfloat16 in (itype, wtype) else torch.float16)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[low]
    assert_rel_close(z, ref_z, tol=tol)
    assert_rel_close(list(grads), list(ref_g), tol=tol)


def test_fast_layer_norm_module_and_autocast():
    from apex.contrib.layer_norm import FastLayerNorm

    ln = FastLayerNorm(64)
    x = torch.randn(4, 5, 64)
    assert_rel_close(ln(x), F.layer_norm(x.double(), (64,)), tol=1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ln(x)
    assert out.dtype == torch.bfloat16
    out.backward(torch.randn_like(out))
    assert ln.weight.grad.dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[\.\.\., 64\]"):
        ln(torch.randn(3, 63))


def test_fast_layer_norm_compat_module(backend_name):
    import fast_layer_norm as fln

    h = 96
    x = torch.randn(10, h)
    gamma, beta = 1 + 0.2 * torch.randn(h), 0.2 * torch.randn(h)
    dz = torch.randn(10, h)
    z, mu, rs = fln.ln_fwd(x, gamma, beta, 1e-5)
    assert mu.dtype == rs.dtype == torch.float32 and mu.shape == (10,)
    ref_z, ref_g = _ref(x, gamma, beta, 1e-5, dz)
    assert_rel_close(z, ref_z, tol=1e-5)
    assert_rel_close(mu, x.double().mean(1), tol=1e-6)
    for mem_eff, saved in ((False, x), (True, z)):
        dx, dg, db, dgp, dbp = fln.ln_bwd(dz, saved, None if mem_eff else mu, rs, gamma, beta, mem_eff)
        assert_rel_close([dx, dg, db], list(ref_g), tol=1e-5)
        assert dgp.shape == (1, h) and dbp.dtype == torch.float32


@pytest.mark.parametrize("itype", [torch.float16, torch.bfloat16], ids=str)
def test_statistics_are_fp32_accurate_for_half_inputs(backend_name, itype):
    """Apex's own test checks mu and rsigma of fp16/bf16 inputs to 5e-6 (sum of absolute errors)."""
    import fast_layer_norm as fln

    x = torch.randn(64, 768).to(itype)
    gamma, beta = torch.randn(768).to(itype), torch.randn(768).to(itype)
    _, mu, rs = fln.ln_fwd(x, gamma, beta, 1e-5)
    mu_ref = x.double().mean(1)
    rs_ref = torch.rsqrt((x.double() - mu_ref[:, None]).square().mean(1) + 1e-5)
    assert ((mu - mu_ref).abs().sum() / mu_ref.abs().sum()).item() < 5e-6
    assert ((rs - rs_ref).abs().sum() / rs_ref.abs().sum()).item() < 5e-6
