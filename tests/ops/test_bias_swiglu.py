"""apex.ops.bias_swiglu: outputs and gradients against a float64 reference on both backends."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.ops import bias_swiglu as S
from apex.testing import TritonTrace, assert_rel_close
from tests import _device
from tests.ops._modes import Recorder as _Recorder

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ref(x, b):
    h = x + b if b is not None else x
    n = h.shape[-1] // 2
    return F.silu(h[..., :n]) * h[..., n:]


def _run(fn, x, b, dy):
    leaves = [x] + ([b] if b is not None else [])
    y = fn(x, b)
    return y, torch.autograd.grad(y, leaves, dy)


def _leaf(v, dtype=None):
    return None if v is None else v.detach().to(dtype or v.dtype).requires_grad_()


def _check(x, b, dy, dtype, backend_name, launches=2):
    ctx = TritonTrace(bounds=True).watch(x, b, dy) if backend_name == "triton" else contextlib.nullcontext()
    with ctx as tr:
        y, grads = _run(S.bias_swiglu, x, b, dy)
    if tr is not None:
        assert tr.launches == launches  # forward, backward (the bias gradient in the same launch)
    ry, rg = _run(_ref, _leaf(x, torch.float64), _leaf(b, torch.float64), dy.double())
    by, bg = _run(_ref, _leaf(x), _leaf(b), dy)
    assert y.dtype == dtype and [g.dtype for g in grads] == [v.dtype for v in (x, b) if v is not None]
    tol = 1e-6 if dtype == torch.float32 else None
    assert_rel_close(y, ry, dtype, tol=tol, baseline=None if tol else by, name="y")
    assert_rel_close(list(grads), list(rg), dtype, tol=tol, baseline=None if tol else list(bg), name="grads")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 2), (3, 7, 34), (5, 2050)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_swiglu_matches_float64(backend_name, dtype, shape, with_bias):
    x = torch.randn(shape).to(dtype).requires_grad_()
    b = torch.randn(shape[-1]).to(dtype).requires_grad_() if with_bias else None
    dy = torch.randn(*shape[:-1], shape[-1] // 2).to(dtype)
    _check(x, b, dy, dtype, backend_name)


def test_bias_swiglu_non_contiguous_and_fp32_bias(backend_name):
    x = torch.randn(34, 9).t().to(torch.bfloat16).requires_grad_()  # [9, 34], column-major
    b = torch.randn(68)[::2].requires_grad_()  # a strided fp32 bias with a bf16 input
    dy = torch.randn(17, 9).t().to(torch.bfloat16)
    assert not x.is_contiguous() and not dy.is_contiguous()
    y, (dx, db) = _run(S.bias_swiglu, x, b, dy)
    assert y.dtype == torch.bfloat16 and dx.dtype == torch.bfloat16 and db.dtype == torch.float32
    ry, (rdx, rdb) = _run(_ref, _leaf(x, torch.float64), _leaf(b, torch.float64), dy.double())
    assert_rel_close([y, dx, db], [ry, rdx, rdb], torch.bfloat16)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), half=st.integers(1, 300))
def test_bias_swiglu_random_shapes(backend_name, rows, half):
    x = torch.randn(rows, 2 * half, requires_grad=True)
    b = torch.randn(2 * half, requires_grad=True)
    dy = torch.randn(rows, half)
    _check(x, b, dy, torch.float32, backend_name)


def test_swiglu_without_bias_is_megatrons_swiglu(backend_name):
    x = torch.randn(4, 6, 10, requires_grad=True)
    y = S.swiglu(x)
    ry = _ref(x.detach().double(), None)
    assert_rel_close(y, ry, tol=1e-6)


def test_compat_module_matches_rocm_signatures(backend_name):
    import fused_bias_swiglu as ext

    x, b, g = torch.randn(16, 64), torch.randn(64), torch.randn(16, 32)
    y = ext.forward(x, b)
    dx = ext.backward(g, x, b)
    x64 = x.double().requires_grad_()
    ry = _ref(x64, b.double())
    (rdx,) = torch.autograd.grad(ry, x64, g.double())
    assert_rel_close(y, ry, tol=1e-6)
    assert_rel_close(dx, rdx, tol=1e-6)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: S.bias_swiglu(torch.randn(3, 7), torch.randn(7)), ValueError, "last dim must be even"),
    (lambda: S.bias_swiglu(torch.randn(3, 8), torch.randn(4)), ValueError, "bias must be a float tensor of shape"),
    (lambda: S.bias_swiglu(torch.ones(3, 8, dtype=torch.int64), None), ValueError, "input must be a float"),
    (lambda: S.bias_swiglu_backward(torch.randn(3, 3), torch.randn(3, 8), None), ValueError, "grad_output"),
    (lambda: S.bias_swiglu("x", None), TypeError, "input must be a torch.Tensor"),
])
def test_bias_swiglu_bad_input(backend_name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


@pytest.mark.parametrize("with_bias_grad", [False, True])
def test_bias_swiglu_backward_refuses_a_gradient_on_another_device(backend_name, device, with_bias_grad):
    """A grad_output on another device than the input (``meta`` standing in) is refused, naming it, before a
    kernel reads it."""
    x, b = torch.randn(3, 8, device=device), torch.randn(8, device=device)
    dy = torch.randn(3, 4, device="meta")
    call = S.bias_swiglu_backward_with_bias_grad if with_bias_grad else S.bias_swiglu_backward
    with pytest.raises(ValueError, match="grad_output is on meta"):
        call(dy, x, b)


def test_bias_swiglu_triton_moves_the_minimum_bytes(triton_device):
    x = torch.randn(48, 200, requires_grad=True)
    b = torch.randn(200)
    dy = torch.randn(48, 100)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        y = S.bias_swiglu(x, b)
    assert tr.launches == 1 and tr.bytes_unique <= 1.05 * (x.nbytes + b.nbytes + y.nbytes)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        torch.autograd.grad(y, x, dy)
    assert tr.launches == 1 and tr.bytes_unique <= 1.05 * (2 * x.nbytes + b.nbytes + dy.nbytes)


def test_bias_swiglu_bias_grad_in_the_same_launch(triton_device):
    # With the bias needing a gradient the backward is still one launch: dx written once, dbias reduced in
    # registers (no pass over dx), deterministic (a fixed summation order, no atomics).
    x = torch.randn(37, 2 * 45, requires_grad=True)
    b = torch.randn(2 * 45, requires_grad=True)
    dy = torch.randn(37, 45)
    with apex.backend("triton"):
        y = S.bias_swiglu(x, b)
        with TritonTrace(bounds=True) as tr:
            dx, db = torch.autograd.grad(y, (x, b), dy)
        dx2, db2 = torch.autograd.grad(S.bias_swiglu(x, b), (x, b), dy)
    assert tr.launches == 1
    assert tr.bytes_unique <= 1.05 * (2 * x.nbytes + 2 * b.nbytes + dy.nbytes)
    assert torch.equal(db, db2) and torch.equal(dx, dx2)
    x64, b64 = _leaf(x, torch.float64), _leaf(b, torch.float64)
    rx, rb = torch.autograd.grad(_ref(x64, b64), (x64, b64), dy.double())
    assert_rel_close([dx, db], [rx, rb], tol=1e-6)


# ------------------------------------------------------------------------------------------ eager path
@pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops under a "
                    "dispatch mode, which takes the registered op by design")
@pytest.mark.parametrize("op", ["bias_swiglu", "bias_gelu"])
@pytest.mark.parametrize("bias_grad", [True, False, None], ids=["dbias", "no-dbias", "no-bias"])
def test_eager_forward_and_backward_skip_the_custom_ops(triton_device, monkeypatch, op, bias_grad):
    """In eager mode on plain tensors the forward and the backward launch the kernels without the custom ops'
    entries (their layers cost more host time than the launch): the same values, bit for bit, as the
    registered ops differentiated by torch.library's autograd. A backward under a dispatch mode still sees
    the registered backward op."""
    from apex.ops import bias_gelu as G
    from apex.ops._dispatch import CustomOp

    mod = S if op == "bias_swiglu" else G
    x = torch.randn(4, 16, device=triton_device, requires_grad=True)
    b = torch.randn(16, device=triton_device, requires_grad=bool(bias_grad)) if bias_grad is not None else None
    leaves = (x, b) if bias_grad else (x,)
    calls: list = []
    call = CustomOp.__call__
    with apex.backend("triton"):
        ref = getattr(torch.ops.apex, f"{op}_fwd")(x, b)
        dy = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, leaves, dy)
        monkeypatch.setattr(CustomOp, "__call__", lambda self, *args: calls.append(self) or call(self, *args))
        y = getattr(mod, op)(x, b)
        grads = torch.autograd.grad(y, leaves, dy)
        assert calls == [], f"{len(calls)} custom-op calls in an eager forward + backward"
        loss = getattr(mod, op)(x, b)
        with _Recorder() as rec:
            mode_grads = torch.autograd.grad(loss, leaves, dy)
    assert f"apex::{op}_bwd{'_dbias' if bias_grad else ''}" in rec.ops, rec.ops
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    torch.testing.assert_close(grads, ref_grads, rtol=0, atol=0)
    torch.testing.assert_close(mode_grads, ref_grads, rtol=0, atol=0)

