"""apex.contrib.bottleneck.Bottleneck against a float64 ResNet bottleneck (output and gradients of the input
and every convolution weight), NCHW and explicit NHWC, with and without the downsampling shortcut."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.contrib.bottleneck import Bottleneck
from apex.testing import assert_rel_close


def _frozen(x, bn):
    scale = bn.weight.double() / bn.running_var.double().sqrt()
    return x * scale.view(1, -1, 1, 1) + (bn.bias.double() - bn.running_mean.double() * scale).view(1, -1, 1, 1)


@pytest.mark.parametrize("nhwc", [False, True])
@pytest.mark.parametrize("cin,cout,stride", [(8, 8, 1), (6, 12, 2)])
def test_bottleneck_matches_float64(cin, cout, stride, nhwc):
    block = Bottleneck(cin, 4, cout, stride=stride, explicit_nhwc=nhwc)
    bns = [block.bn1, block.bn2, block.bn3] + ([block.downsample[1]] if block.downsample is not None else [])
    for bn in bns:  # non-trivial frozen statistics
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.normal_()
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, cin, 9, 7)
    xin = (x.permute(0, 2, 3, 1).contiguous() if nhwc else x).requires_grad_()
    y = block(xin)
    dy = torch.randn_like(y)
    weights = list(block.parameters())
    grads = torch.autograd.grad(y, [xin] + weights, dy)

    def w(p):  # float64 NCHW weights
        q = p.detach().double()
        return (q.permute(0, 3, 1, 2) if nhwc else q).requires_grad_()

    w64 = [w(p) for p in weights]
    x64 = xin.detach().double().requires_grad_()
    xx = x64.permute(0, 3, 1, 2) if nhwc else x64
    c1, c2, c3 = w64[0:3] if block.downsample is None else (w64[1], w64[2], w64[3])
    out = F.relu(_frozen(F.conv2d(xx, c1, stride=stride), block.bn1))
    out = F.relu(_frozen(F.conv2d(out, c2, padding=1), block.bn2))
    out = _frozen(F.conv2d(out, c3), block.bn3)
    sc = xx if block.downsample is None else _frozen(F.conv2d(xx, w64[0], stride=stride), block.downsample[1])
    ref = F.relu(out + sc)
    ref = ref.permute(0, 2, 3, 1) if nhwc else ref
    ref_grads = torch.autograd.grad(ref, [x64] + w64, dy.double())
    assert_rel_close(y, ref, tol=1e-5)
    assert_rel_close(grads[0], ref_grads[0], tol=1e-5)
    for g, r in zip(grads[1:], ref_grads[1:]):
        assert_rel_close(g, r.permute(0, 2, 3, 1) if nhwc else r, tol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError):
        Bottleneck(8, 4, 8, groups=2)
    with pytest.raises(ValueError):
        Bottleneck(8, 4, 8, norm_func=torch.nn.BatchNorm2d)
