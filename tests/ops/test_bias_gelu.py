"""apex.ops.bias_gelu: outputs and gradients against a float64 reference on both backends."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

import apex
from apex.ops import bias_gelu as G
from apex.testing import TritonTrace, assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _megatron(x, b):
    """Megatron-LM's bias_gelu formula, as written there (the unfused composition)."""
    h = x + b if b is not None else x
    return h * 0.5 * (1.0 + torch.tanh(0.79788456 * h * (1 + 0.044715 * h * h)))


def _ref(x, b):
    return F.gelu(x + b if b is not None else x, approximate="tanh")


def _run(fn, x, b, dy):
    leaves = [x] + ([b] if b is not None else [])
    y = fn(x, b)
    return y, torch.autograd.grad(y, leaves, dy)


def _leaf(v, dtype=None):
    return None if v is None else v.detach().to(dtype or v.dtype).requires_grad_()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7, 33), (5, 2049)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_gelu_matches_float64(backend_name, dtype, shape, with_bias):
    x = (3 * torch.randn(shape)).to(dtype).requires_grad_()
    b = torch.randn(shape[-1]).to(dtype).requires_grad_() if with_bias else None
    dy = torch.randn(shape).to(dtype)
    ctx = TritonTrace(bounds=True).watch(x, b, dy) if backend_name == "triton" else contextlib.nullcontext()
    with ctx as tr:
        y, grads = _run(G.bias_gelu, x, b, dy)
    if tr is not None:
        assert tr.launches == 2
    ry, rg = _run(_ref, _leaf(x, torch.float64), _leaf(b, torch.float64), dy.double())
    by, bg = _run(_megatron, _leaf(x), _leaf(b), dy)
    tol = 1e-6 if dtype == torch.float32 else None
    assert y.dtype == dtype and grads[0].dtype == dtype
    assert_rel_close(y, ry, dtype, tol=tol, baseline=None if tol else by, name="y")
    assert_rel_close(list(grads), list(rg), dtype, tol=tol, baseline=None if tol else list(bg), name="grads")


def test_bias_gelu_matches_megatron_formula_in_float64():
    x, b = torch.randn(64, 48, dtype=torch.float64), torch.randn(48, dtype=torch.float64)
    # Megatron's constant 0.79788456 is √(2/π) to 8 digits: the two differ by about 1e-9.
    assert_rel_close(G.bias_gelu(x, b), _megatron(x, b), tol=1e-8)


def test_bias_gelu_non_contiguous(backend_name):
    x = torch.randn(40, 9).t().requires_grad_()
    b = torch.randn(40, requires_grad=True)
    dy = torch.randn(40, 9).t()
    y, grads = _run(G.bias_gelu, x, b, dy)
    ry, rg = _run(_ref, _leaf(x, torch.float64), _leaf(b, torch.float64), dy.double())
    assert_rel_close([y, *grads], [ry, *rg], tol=1e-6)


@pytest.mark.parametrize("call,match", [
    (lambda: G.bias_gelu(torch.randn(3, 8), torch.randn(7)), "bias must be a float tensor of shape"),
    (lambda: G.bias_gelu_backward(torch.randn(3, 7), torch.randn(3, 8), None), "grad_output"),
])
def test_bias_gelu_bad_input(backend_name, call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("with_bias_grad", [False, True])
def test_bias_gelu_backward_refuses_a_gradient_on_another_device(backend_name, device, with_bias_grad):
    """A grad_output on another device than the input (``meta`` standing in) is refused, naming it, before a
    kernel reads it."""
    x, b = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    dy = torch.randn(3, 8, device="meta")
    call = G.bias_gelu_backward_with_bias_grad if with_bias_grad else G.bias_gelu_backward
    with pytest.raises(ValueError, match="grad_output is on meta"):
        call(dy, x, b)


def test_bias_gelu_triton_moves_the_minimum_bytes(triton_device):
    x = torch.randn(40, 300, requires_grad=True)
    b = torch.randn(300)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        y = G.bias_gelu(x, b)
    assert tr.launches == 1 and tr.bytes_unique <= 1.05 * (2 * x.nbytes + b.nbytes)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        torch.autograd.grad(y, x, torch.randn(40, 300))
    assert tr.launches == 1 and tr.bytes_unique <= 1.05 * (3 * x.nbytes + b.nbytes)


def test_bias_gelu_bias_grad_in_the_same_launch(triton_device):
    # One backward launch writes dx once and reduces dbias in registers, deterministically.
    x = torch.randn(53, 70, requires_grad=True)
    b = torch.randn(70, requires_grad=True)
    dy = torch.randn(53, 70)
    with apex.backend("triton"):
        y = G.bias_gelu(x, b)
        with TritonTrace(bounds=True) as tr:
            dx, db = torch.autograd.grad(y, (x, b), dy)
        dx2, db2 = torch.autograd.grad(G.bias_gelu(x, b), (x, b), dy)
    assert tr.launches == 1 and tr.bytes_unique <= 1.05 * (3 * x.nbytes + 2 * b.nbytes)
    assert torch.equal(db, db2) and torch.equal(dx, dx2)
    x64, b64 = _leaf(x, torch.float64), _leaf(b, torch.float64)
    rx, rb = torch.autograd.grad(_ref(x64, b64), (x64, b64), dy.double())
    assert_rel_close([dx, db], [rx, rb], tol=1e-6)
