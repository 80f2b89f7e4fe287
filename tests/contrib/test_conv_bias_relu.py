"""apex.contrib.conv_bias_relu: the four blocks against float64 compositions (outputs, gradients of x,
weight and bias), channels_last, autocast casting, the compatibility functions and argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.contrib.conv_bias_relu import ConvBias, ConvBiasMaskReLU, ConvBiasReLU, ConvFrozenScaleBiasReLU
from apex.testing import assert_rel_close


def _inputs(dtype, channels_last, n=2, c=5, k=7, hw=9, ks=3):
    x = torch.randn(n, c, hw, hw + 2).to(dtype)
    w = (0.3 * torch.randn(k, c, ks, ks)).to(dtype)
    if channels_last:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    b = torch.randn(1, k, 1, 1).to(dtype)
    return x.requires_grad_(), w.requires_grad_(), b.requires_grad_()


def _ref(kind, x, w, b, extra, pad, stride):
    y = F.conv2d(x, w, None, stride, pad)
    if kind == "frozen":
        return torch.relu(y * extra + b)
    y = y + b
    if kind == "mask":
        y = y * extra
    return y if kind == "bias" else torch.relu(y)


def _run(kind, x, w, b, extra, pad, stride):
    if kind == "relu":
        return ConvBiasReLU(x, w, b, pad, stride)
    if kind == "bias":
        return ConvBias(x, w, b, pad, stride)
    if kind == "mask":
        return ConvBiasMaskReLU(x, w, b, extra, pad, stride)
    return ConvFrozenScaleBiasReLU(x, w, extra, b, pad, stride)


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pad,stride", [(1, 1), (0, 2)])
@pytest.mark.parametrize("kind", ["relu", "bias", "mask", "frozen"])
def test_blocks_match_float64(kind, pad, stride, dtype, channels_last):
    x, w, b = _inputs(dtype, channels_last)
    out_hw = [(s + 2 * pad - 3) // stride + 1 for s in x.shape[2:]]
    extra = None
    if kind == "mask":
        extra = (torch.randn(2, 7, *out_hw) > 0).to(torch.int8)
    elif kind == "frozen":
        extra = torch.randn(1, 7, 1, 1).to(dtype)
    y = _run(kind, x, w, b, extra, pad, stride)
    assert y.dtype == dtype
    if channels_last:
        assert y.is_contiguous(memory_format=torch.channels_last)
    dy = torch.randn_like(y)
    wrt = (x, w) if kind == "frozen" else (x, w, b)
    grads = torch.autograd.grad(y, wrt, dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    e64 = extra.double() if extra is not None else None
    ref = _ref(kind, x64, w64, b64, e64, pad, stride)
    ref_grads = torch.autograd.grad(ref, (x64, w64) if kind == "frozen" else (x64, w64, b64), dy.double())
    # baseline: PyTorch's own composition in the same dtype
    xb, wb, bb = (t.detach().requires_grad_() for t in (x, w, b))
    base = _ref(kind, xb, wb, bb, extra.to(dtype) if extra is not None else None, pad, stride)
    base_grads = torch.autograd.grad(base, (xb, wb) if kind == "frozen" else (xb, wb, bb), dy)
    tol = 1e-5 if dtype == torch.float32 else None
    assert_rel_close(y, ref, dtype, tol=tol, baseline=base)
    assert_rel_close(list(grads), list(ref_grads), dtype, tol=tol, baseline=list(base_grads))


def test_autocast_casts_to_half_like_apex():
    x, w, b = _inputs(torch.float32, True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ConvBiasReLU(x, w, b, 1, 1)
    assert y.dtype == torch.float16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32


def test_compat_functions():
    import fused_conv_bias_relu as fcbr

    x, w, b = (t.detach() for t in _inputs(torch.float64, False))
    (out,) = fcbr.forward([x, w, b], 1, 1)
    dy = torch.randn_like(out)
    dx, dw, db = fcbr.backward([x, w, out, dy], 1, 1)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    ref = torch.relu(F.conv2d(xr, wr, br.view(-1), 1, 1))
    rdx, rdw, rdb = torch.autograd.grad(ref, (xr, wr, br), dy)
    assert_rel_close([out, dx, dw, db], [ref, rdx, rdw, rdb], tol=1e-12)
    (out2,) = fcbr.forward_no_relu([x, w, b], 0, 2)
    assert_rel_close(out2, F.conv2d(x, w, b.view(-1), 2, 0), tol=1e-12)
    scale = torch.rand(1, 7, 1, 1, dtype=torch.float64) + 0.5
    out3 = fcbr.forward_cscale_cbias_relu([x, w, scale, b], 1, 1)
    dx3, dw3 = fcbr.backward_cscale_cbias_relu([x, w, scale, out3, dy], 1, 1)
    ref3 = torch.relu(F.conv2d(xr, wr, None, 1, 1) * scale + b)
    r3 = torch.autograd.grad(ref3, (xr, wr), dy)
    assert_rel_close([out3, dx3, dw3], [ref3, *r3], tol=1e-12)


@pytest.mark.parametrize("case", ["channels", "bias", "mask", "padding"])
def test_bad_input(case):
    x, w, b = _inputs(torch.float32, False)
    with pytest.raises(ValueError):
        if case == "channels":
            ConvBiasReLU(x[:, :4], w, b, 1, 1)
        elif case == "bias":
            ConvBias(x, w, b[:, :3], 1, 1)
        elif case == "mask":
            ConvBiasMaskReLU(x, w, b, torch.ones(2, 7, 3, 3, dtype=torch.int8), 1, 1)
        else:
            ConvBiasReLU(x, w, b, -1, 1)


def test_autocast_gradient_matches_fp32_loss_reference():
    # Upstream's test computes its reference loss as ``(out_ ** 2).sum() / numel`` under autocast: on CUDA
    # ``pow`` and ``sum`` autocast to fp32, on CPU they stay fp16, where 1/numel rounds to an fp16 subnormal.
    # Against the CUDA semantics (loss in fp32, gradient rounded once to fp16) the block is bit-identical.
    torch.manual_seed(0)
    x = torch.randint(-16, 16, (2, 8, 64, 64)).float().to(memory_format=torch.channels_last)
    conv = torch.nn.Conv2d(8, 16, 1, stride=1)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    w1, w2 = conv.weight.detach().clone().requires_grad_(), conv.weight.detach().clone().requires_grad_()
    b1, b2 = conv.bias.detach().clone().requires_grad_(), conv.bias.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.half):
        out = ConvBias(x1, w1, b1.reshape(1, -1, 1, 1), 0, 1)
        ref = F.conv2d(x2, w2, b2)
        ((out.float() ** 2).sum() / out.numel()).backward()
        ((ref.float() ** 2).sum() / ref.numel()).backward()
    assert out.dtype == ref.dtype == torch.float16
    for a, r in ((out, ref), (w1.grad, w2.grad), (b1.grad, b2.grad), (x1.grad, x2.grad)):
        torch.testing.assert_close(a, r, atol=1e-3, rtol=1e-3)
