"""apex.fused_dense modules against float64 references on both backends; init, autocast, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from apex.fused_dense import (
    DenseNoBiasFunc,
    FusedDense,
    FusedDenseFunc,
    FusedDenseGeluDense,
    FusedDenseGeluDenseFunc,
    dense_no_bias_function,
    fused_dense_function,
    fused_dense_gelu_dense_function,
)
from apex.testing import assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gelu_dense(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)


def _check(module, ref_fn, x, dtype):
    module = module.to(dtype)
    x = x.to(dtype).requires_grad_()
    params = [x, *module.parameters()]
    y = module(x)
    dy = torch.randn(y.shape).to(dtype)
    g = torch.autograd.grad(y, params, dy)
    p64 = [p.detach().double().requires_grad_() for p in params]
    ref_y = ref_fn(*p64)
    ref_g = torch.autograd.grad(ref_y, p64, dy.double())
    base_y = ref_fn(*params)
    base_g = torch.autograd.grad(base_y, params, dy)
    tol = 1e-5 if dtype == torch.float32 else None
    assert y.dtype == dtype and all(t.dtype == dtype for t in g)
    assert_rel_close(y, ref_y, dtype, tol=tol, baseline=base_y, name="y")
    assert_rel_close(list(g), list(ref_g), dtype, tol=tol, baseline=list(base_g), name="grads")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("pair", [(1, 7), (129, 1), (7, 1000), (1000, 129)], ids=str)
def test_fused_dense(backend_name, pair, bias, dtype):
    m = FusedDense(*pair, bias=bias)
    _check(m, lambda x, w, b=None: F.linear(x, w, b), torch.randn(6, pair[0]), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes", [(7, 129, 1), (1, 7, 129), (129, 33, 7)], ids=str)
def test_fused_dense_gelu_dense(backend_name, sizes, dtype):
    m = FusedDenseGeluDense(*sizes)
    _check(m, _gelu_dense, torch.randn(5, sizes[0]), dtype)


def test_leading_dims(backend_name):
    m = FusedDenseGeluDense(5, 9, 3)
    x = torch.randn(2, 3, 5)
    y = m(x)
    assert y.shape == (2, 3, 3)
    assert_rel_close(y, _gelu_dense(x.double(), *[p.double() for p in m.parameters()]), tol=1e-5)


def test_two_d_input_takes_no_view(backend_name):
    """Rows in, rows out: a 2-D input's output and gradient are the kernels' own tensors (no reshape or view
    around them, each an operator call), the same values as through a leading dimension."""
    m = FusedDense(5, 3)
    x = torch.randn(4, 5, requires_grad=True)
    y = m(x)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    assert y._base is None and dx._base is None
    x3 = x.detach().view(1, 4, 5).requires_grad_()
    y3 = m(x3)
    (dx3,) = torch.autograd.grad(y3, x3, torch.ones_like(y3))
    assert torch.equal(y3.view(4, 3), y) and torch.equal(dx3.view(4, 5), dx)


def test_no_grad_call_records_nothing(backend_name, monkeypatch):
    """With nothing to differentiate (no_grad, or no input that requires grad) the chain runs without the
    autograd Function's context and saved tensors: the same values as with a graph."""
    import apex.fused_dense.fused_dense as public
    import apex.ops.fused_dense as chain

    m, g = FusedDense(5, 3), FusedDenseGeluDense(5, 7, 3)
    x = torch.randn(2, 4, 5)
    with_graph = m(x), g(x)
    assert all(y.grad_fn is not None for y in with_graph)

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(chain, "save_chain", refuse)
    monkeypatch.setattr(public, "save_chain", refuse)
    with torch.no_grad():
        plain = m(x), g(x)
    for y, ref in zip(plain, with_graph):
        assert y.grad_fn is None and torch.equal(y, ref.detach())
    m.requires_grad_(False)
    assert torch.equal(m(x), with_graph[0].detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast(backend_name, device, dtype):
    m = FusedDenseGeluDense(7, 33, 5)
    d = FusedDense(7, 4, bias=False)
    x = torch.randn(6, 7, requires_grad=True)
    # Autocast of the device the case runs on: the GPU's under APEX_TEST_DEVICE=cuda.
    with torch.autocast(device.type, dtype=dtype):
        y, y2 = m(x), d(x)
        base = _gelu_dense(x, *m.parameters())
    assert y.dtype == dtype and y2.dtype == dtype
    (y.float().sum() + y2.float().sum()).backward()
    assert m.weight1.grad.dtype == torch.float32 and d.weight.grad.dtype == torch.float32
    assert_rel_close(y, _gelu_dense(x.detach().double(), *[p.double() for p in m.parameters()]), dtype,
                     baseline=base)


def test_initialisation_like_linear():
    m = FusedDense(400, 300)
    bound = 1 / math.sqrt(400)
    for p in (m.weight, m.bias):
        assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound
    assert abs(m.weight.std().item() - bound / math.sqrt(3)) < 0.02 * bound
    g = FusedDenseGeluDense(40, 30, 20)
    assert g.weight2.abs().max() <= 1 / math.sqrt(30) and g.bias1.abs().max() <= 1 / math.sqrt(40)
    assert "in_features=400, out_features=300, bias=True" in repr(m)


def test_functions_and_wrappers():
    x, w, b = torch.randn(4, 5), torch.randn(3, 5), torch.randn(3)
    w2, b2 = torch.randn(2, 3), torch.randn(2)
    ref = F.linear(x, w, b)
    assert torch.allclose(FusedDenseFunc.apply(x, w, b), ref, atol=1e-6)
    assert torch.allclose(fused_dense_function(x, w, b), ref, atol=1e-6)
    assert torch.allclose(DenseNoBiasFunc.apply(x, w), F.linear(x, w), atol=1e-6)
    assert torch.allclose(dense_no_bias_function(x, w), F.linear(x, w), atol=1e-6)
    gd = _gelu_dense(x, w, b, w2, b2)
    assert torch.allclose(FusedDenseGeluDenseFunc.apply(x, w, b, w2, b2), gd, atol=1e-6)
    assert torch.allclose(fused_dense_gelu_dense_function(x, w, b, w2, b2), gd, atol=1e-6)


def test_errors():
    with pytest.raises(ValueError, match="bias=False"):
        FusedDenseGeluDense(4, 5, 6, bias=False)
    with pytest.raises(ValueError, match="in_features"):
        FusedDense(0, 3)
    with pytest.raises(ValueError, match="intermediate_features"):
        FusedDenseGeluDense(3, -1, 2)
    m = FusedDense(5, 3)
    with pytest.raises(ValueError, match="weight 0 expects 5 input features"):
        m(torch.randn(2, 4))
    with pytest.raises(TypeError, match="input must be a floating"):
        m(torch.ones(2, 5, dtype=torch.int32))
    with pytest.raises(TypeError, match="weight 0 has dtype"):
        m(torch.randn(2, 5).half())
    with pytest.raises(ValueError, match="bias1 and bias2"):
        fused_dense_gelu_dense_function(torch.randn(2, 5), torch.randn(3, 5), None, torch.randn(2, 3), None)
    g = FusedDenseGeluDense(5, 4, 3)
    with pytest.raises(ValueError, match="weight 1 expects 6 input features but the weight 0.s out_features is 4"):
        fused_dense_gelu_dense_function(torch.randn(2, 5), g.weight1, g.bias1, torch.randn(3, 6), g.bias2)


@pytest.mark.parametrize("which", ["bias", "bias1", "bias2"])
def test_bias_on_another_device_is_refused(backend_name, device, which):
    """A bias on another device than the input is refused with an error naming it, before any kernel reads it
    (a kernel would take its address for a device one); ``meta`` stands in for another device."""
    x = torch.randn(2, 5, device=device)
    if which == "bias":
        m = FusedDense(5, 3).to(device)
        with torch.no_grad():
            m.bias = torch.nn.Parameter(m.bias.to("meta"))
        call, err = lambda: m(x), "bias 0 is on meta"
    else:
        g = FusedDenseGeluDense(5, 4, 3).to(device)
        with torch.no_grad():
            setattr(g, which, torch.nn.Parameter(getattr(g, which).to("meta")))
        call, err = lambda: g(x), f"bias {int(which[-1]) - 1} is on meta"
    before = x.clone()
    with pytest.raises(ValueError, match=err):
        call()
    assert torch.equal(x, before)


def test_bf16_output_rounded_once():
    # Upstream's test_fused_dense[bf16] compares with ``matmul(x, Wᵀ) + bias`` in bf16, which rounds twice
    # (after the product and after the bias add). FusedDense adds the bias before its single rounding, as
    # cuBLASLt's bias epilogue does: it must stay the once-rounded result, not the twice-rounded one.
    torch.manual_seed(0)
    x = torch.randn(96, 256).bfloat16()
    dense = FusedDense(256, 192).bfloat16()
    with torch.no_grad():
        y = dense(x)
        once = (x.double() @ dense.weight.double().t() + dense.bias.double()).bfloat16()
        twice = torch.matmul(x, dense.weight.t()) + dense.bias
    assert (y != once).float().mean().item() < 1e-3  # only fp32-accumulation ties
    assert (twice != once).float().mean().item() > 0.05  # the test's reference is the one that is off


class _Doubled(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_parametrized_parameters(backend_name):
    """A parametrization (``torch.nn.utils.parametrize``) puts a property where a registered parameter was:
    the modules read registered parameters straight from ``_parameters``, and a parametrized one through
    the property: its value in the forward, its gradient to the original."""
    from torch.nn.utils import parametrize

    m, g = FusedDense(5, 3), FusedDenseGeluDense(5, 7, 3)
    parametrize.register_parametrization(m, "weight", _Doubled())
    parametrize.register_parametrization(g, "bias2", _Doubled())
    x = torch.randn(4, 5, requires_grad=True)
    w = m.parametrizations.weight.original
    b2 = g.parametrizations.bias2.original
    y, yg = m(x), g(x)
    gw, gb2 = torch.autograd.grad(y.sum() + yg.sum(), (w, b2))
    x64, w64 = x.detach().double(), w.detach().double().requires_grad_()
    ref = F.linear(x64, 2 * w64, m.bias.detach().double())
    ref_g = _gelu_dense(x64, g.weight1.detach().double(), g.bias1.detach().double(), g.weight2.detach().double(),
                        2 * b2.detach().double())
    assert_rel_close(y, ref, torch.float32)
    assert_rel_close(yg, ref_g, torch.float32)
    assert_rel_close(gw, torch.autograd.grad(ref.sum(), w64)[0], torch.float32, name="weight grad")
    assert torch.equal(gb2, torch.full_like(gb2, 2 * x.shape[0]))
