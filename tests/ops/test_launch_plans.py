"""Launch plans cached per shape (apex._kernels._tuning.plan_cache): a call never takes another shape's, dtype's
or configuration's plan. A stale plan is a wrong grid (rows left unwritten) or wrong blocks: values are checked."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from apex.testing import assert_rel_close


def _ln_ref(x, w, b):
    return F.layer_norm(x.double(), x.shape[-1:], w.double(), b.double(), 1e-5)


@pytest.mark.parametrize("shapes", [[(16, 64), (40, 64), (3, 64)], [(8, 64), (8, 200), (8, 16)]])
def test_layer_norm_plans_follow_the_shape(triton_device, shapes):
    import apex
    from apex.normalization import FusedLayerNorm

    for m, n in shapes * 2:  # each shape twice: the second call takes its cached plan
        mod = FusedLayerNorm(n).to(triton_device)
        with torch.no_grad():
            mod.weight.uniform_(0.5, 1.5)
            mod.bias.uniform_(-0.5, 0.5)
        x = torch.randn(m, n, device=triton_device, requires_grad=True)
        with apex.backend("triton"):
            y = mod(x)
            dy = torch.randn_like(y)
            gx, gw, gb = torch.autograd.grad(y, (x, mod.weight, mod.bias), dy)
        x64 = x.detach().double().requires_grad_()
        w64, b64 = (p.detach().double().requires_grad_() for p in (mod.weight, mod.bias))
        ref = F.layer_norm(x64, (n,), w64, b64, 1e-5)
        rgx, rgw, rgb = torch.autograd.grad(ref, (x64, w64, b64), dy.double())
        assert_rel_close([y, gx, gw, gb], [ref, rgx, rgw, rgb], torch.float32)


def test_rms_norm_plans_follow_the_dtype(triton_device):
    import apex
    from apex.normalization import FusedRMSNorm

    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.float16):
        mod = FusedRMSNorm(96).to(triton_device, dtype)
        x = torch.randn(24, 96, device=triton_device, dtype=dtype)
        with apex.backend("triton"), torch.no_grad():
            y = mod(x)
        x64 = x.double()
        ref = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + mod.eps) * mod.weight.double()
        assert y.dtype == dtype
        assert_rel_close([y], [ref], dtype)


def test_an_override_or_an_assumed_device_replaces_the_cached_plan(triton_device):
    """The plan cached outside an override block is not the one taken inside it, nor after it."""
    import apex
    from apex._kernels import _tuning
    from apex.normalization import FusedLayerNorm

    if triton_device.type == "meta":
        pytest.skip("compares computed values")
    mod = FusedLayerNorm(64).to(triton_device)
    x = torch.randn(32, 64, device=triton_device)
    ref = _ln_ref(x, mod.weight.detach(), mod.bias.detach())
    with apex.backend("triton"), torch.no_grad():
        mod(x)
        base = dict(_tuning.last["layer_norm.fwd"])
        for rows in (1, 2, 1):
            with _tuning.override("layer_norm.fwd", rows=rows, warps=1, programs_per_sm=0):
                y = mod(x)
                assert _tuning.last["layer_norm.fwd"]["rows"] == rows
                assert_rel_close([y], [ref], torch.float32)
            y = mod(x)
            assert _tuning.last["layer_norm.fwd"] == base
            assert_rel_close([y], [ref], torch.float32)
    # A GPU of 3 SMs: the backward's grid (programs per SM) differs from the one cached for this shape.
    xb = torch.randn(32, 64, device=triton_device, requires_grad=True)
    x64 = xb.detach().double().requires_grad_()
    dy = torch.randn(32, 64, device=triton_device)
    ref = _ln_ref(x64, mod.weight.detach(), mod.bias.detach())
    (rgx,) = torch.autograd.grad(ref, x64, dy.double())
    with apex.backend("triton"):
        for assumed in (False, True, False):
            with _tuning.assume_device("a GPU with 3 SMs", 3) if assumed else contextlib.nullcontext():
                y = mod(xb)
                (gx,) = torch.autograd.grad(y, xb, dy)
            assert_rel_close([y, gx], [ref, rgx], torch.float32)


def test_cross_entropy_plans_follow_the_vocabulary_and_the_backend(triton_device):
    import apex
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    for m, v in [(12, 50), (12, 300), (5, 50), (12, 50)]:
        x = torch.randn(m, v, device=triton_device, requires_grad=True)
        lab = torch.randint(1, v, (m,), device=triton_device)
        outs = []
        for name in ("triton", "torch", "triton"):
            if name == "torch" and triton_device.type != "cpu":
                continue
            with apex.backend(name):
                loss = SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False)
                (g,) = torch.autograd.grad(loss.sum(), x)
            outs.append((loss, g))
        ref = F.cross_entropy(x.detach().double(), lab, reduction="none", label_smoothing=0.1)
        x64 = x.detach().double().requires_grad_()
        (rg,) = torch.autograd.grad(F.cross_entropy(x64, lab, reduction="sum", label_smoothing=0.1), x64)
        for loss, g in outs:
            assert_rel_close([loss, g], [ref, rg], torch.float32)


def test_gemm_plans_follow_the_shape(triton_device):
    """FusedDense's GEMM keeps its block sizes and grid per (m, n, k, dtype): a larger output after a smaller
    one with the same other sizes gets a grid that covers it."""
    import apex
    from apex.fused_dense import FusedDense

    for m, k, n in [(8, 32, 16), (150, 32, 16), (8, 32, 200), (8, 96, 16)] * 2:
        mod = FusedDense(k, n).to(triton_device)
        x = torch.randn(m, k, device=triton_device)
        with apex.backend("triton"), torch.no_grad():
            y = mod(x)
        ref = F.linear(x.double(), mod.weight.double(), mod.bias.double())
        assert_rel_close(y, ref, torch.float32)
