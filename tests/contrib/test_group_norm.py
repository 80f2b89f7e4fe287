"""apex.contrib.group_norm: Apex's GroupNorm module, its helpers and the ``group_norm_cuda`` module."""

import pytest
import torch
import torch.nn.functional as F

from apex.testing import assert_rel_close


def _ref(x, g, w, b, eps, act):
    y = F.group_norm(x.double(), g, w.double(), b.double(), eps)
    return F.silu(y) if act in ("silu", "swish") else y


@pytest.mark.parametrize("act", [None, "silu", "swish"])
@pytest.mark.parametrize("xdtype,wdtype", [(torch.float32, torch.float32), (torch.float16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)], ids=str)
def test_group_norm_module_nhwc(backend_name, xdtype, wdtype, act):
    from apex.contrib.group_norm import GroupNorm

    n, c, h, w, g = 2, 32, 5, 6, 8
    gn = GroupNorm(g, c, 1e-5, dtype=wdtype, act=act)
    with torch.no_grad():
        gn.weight.copy_(torch.rand(c))
        gn.bias.copy_(torch.rand(c))
    x = (-2.3 + 0.5 * torch.randn(n, c, h, w)).to(xdtype).to(memory_format=torch.channels_last)
    x.requires_grad_()
    dy = 0.1 * torch.randn_like(x)
    y = gn(x)
    y.backward(dy)
    assert y.dtype == xdtype and y.is_contiguous(memory_format=torch.channels_last)
    x64 = x.detach().double().requires_grad_()
    w64 = gn.weight.detach().double().requires_grad_()
    b64 = gn.bias.detach().double().requires_grad_()
    ref = _ref(x64, g, w64, b64, 1e-5, act)
    ref.backward(dy.double())
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2 * 2 ** -8}[xdtype]
    assert_rel_close(y, ref, tol=tol)
    assert_rel_close(x.grad, x64.grad, tol=tol)
    wtol = 1e-5 if wdtype == torch.float32 else 2 * 2 ** -8
    assert_rel_close([gn.weight.grad, gn.bias.grad], [w64.grad, b64.grad], tol=wtol)


def test_helpers_and_legality():
    from apex.contrib.group_norm import GroupNorm
    from apex.contrib.group_norm.group_norm import (
        cuda_group_norm_nhwc_one_pass,
        cuda_group_norm_nhwc_two_pass,
        get_cc_and_sm_count,
        torch_group_norm,
    )

    x = torch.randn(2, 8, 3, 3).to(memory_format=torch.channels_last)
    w, b = torch.rand(8), torch.rand(8)
    for fn in (cuda_group_norm_nhwc_one_pass, cuda_group_norm_nhwc_two_pass, torch_group_norm):
        assert_rel_close(fn(x, 4, w, b, 1e-5, "swish"), _ref(x, 4, w, b, 1e-5, "swish"), tol=1e-5)
    gn = GroupNorm(4, 8, act="silu")
    assert gn._check_legality(x) and not gn._check_v2_legality(x)
    assert not gn._check_legality(torch.randn(2, 6, 3))
    assert "act=silu" in repr(gn)
    if not torch.cuda.is_available():
        assert get_cc_and_sm_count(0) == ((0, 0), 0)
    with pytest.raises(ValueError, match="divisible"):
        GroupNorm(3, 8)
    with pytest.raises(ValueError, match="act must be"):
        GroupNorm(4, 8, act="gelu")


def test_group_norm_compiles_without_graph_breaks(backend_name):
    from apex.contrib.group_norm import GroupNorm

    torch._dynamo.reset()
    model = GroupNorm(2, 4, act="silu")
    x = torch.randn(2, 4, 3, 3).to(memory_format=torch.channels_last)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_rel_close(compiled(x), model(x), tol=1e-6)


def test_compat_module_names():
    import group_norm_cuda

    assert sorted(group_norm_cuda.__all__) == ["backward", "forward"]
