"""apex.ops.group_norm: outputs and all gradients against a float64 reference on both backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.ops import group_norm as GN
from apex.testing import assert_rel_close
from tests.ops._norms import DTYPES, trace

# (shape, groups)
SHAPES = [((2, 6, 5, 7), 3), ((2, 16, 4, 3), 4), ((1, 12, 33), 4), ((2, 10, 3, 2, 3), 5), ((4, 6), 2)]


def _inputs(shape, dtype, wdtype=None, affine=True):
    c = shape[1]
    x = (torch.randn(shape) * 0.7 - 0.4).to(dtype)
    wdtype = wdtype or dtype
    w = (1 + 0.3 * torch.randn(c)).to(wdtype).requires_grad_() if affine else None
    b = (0.2 * torch.randn(c)).to(wdtype).requires_grad_() if affine else None
    dy = torch.randn(shape).to(dtype)
    return x, w, b, dy


def _ref(x, groups, w, b, eps, silu, dy):
    leaves = [x.detach().double().requires_grad_()] + [p.detach().double().requires_grad_()
                                                       for p in (w, b) if p is not None]
    y = F.group_norm(leaves[0], groups, *(leaves[1:] or [None, None]), eps)
    if silu:
        y = F.silu(y)
    return y.detach(), torch.autograd.grad(y, leaves, dy.double())


def _run(x, groups, w, b, eps, act, dy, fmt=None):
    xl = x.detach().clone()
    if fmt is not None:
        xl = xl.to(memory_format=fmt)
    xl.requires_grad_()
    y = GN.group_norm(xl, groups, w, b, eps, act)
    leaves = [xl] + [p for p in (w, b) if p is not None]
    return y, torch.autograd.grad(y, leaves, dy)


def _baseline(x, groups, w, b, eps, silu, dy):
    leaves = [x.detach().clone().requires_grad_()] + [p.detach().clone().to(x.dtype).requires_grad_()
                                                      for p in (w, b) if p is not None]
    y = F.group_norm(leaves[0], groups, *(leaves[1:] or [None, None]), eps)
    if silu:
        y = F.silu(y)
    return y, torch.autograd.grad(y, leaves, dy)


def _check(y, grads, x, groups, w, b, eps, silu, dy, dtype):
    ref_y, ref_g = _ref(x, groups, w, b, eps, silu, dy)
    by, bg = _baseline(x, groups, w, b, eps, silu, dy)
    if dtype == torch.float32:
        # Tiny groups (2 elements: x̂ = ±1) cancel dx catastrophically in any fp32 arithmetic: the bound is
        # 1e-5 or twice PyTorch's own fp32 error, whichever is larger.
        assert_rel_close(y, ref_y, tol=1e-5, baseline=by, name="y")
        assert_rel_close(list(grads), list(ref_g), tol=1e-5, baseline=list(bg), name="grads")
        return
    tol = 2 * 2 ** -8 if dtype == torch.bfloat16 else None  # the interpreter truncates fp32 → bf16
    assert_rel_close(y, ref_y, dtype, tol=tol, baseline=by, name="y")
    assert_rel_close(list(grads), list(ref_g), dtype, tol=tol, baseline=list(bg), name="grads")


@pytest.mark.parametrize("act", ["", "silu"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,groups", SHAPES, ids=str)
def test_group_norm_matches_float64(backend_name, shape, groups, dtype, act):
    x, w, b, dy = _inputs(shape, dtype)
    with trace(backend_name, x, w, b, dy) as tr:
        y, grads = _run(x, groups, w, b, 1e-5, act, dy)
    if tr is not None:
        # One fused forward, one fused backward, and the parameter gradients' column sum over the samples.
        assert tr.launches == (2 if shape[0] == 1 else 3)
    assert y.dtype == dtype and [g.dtype for g in grads] == [dtype] * 3
    _check(y, grads, x, groups, w, b, 1e-5, act == "silu", dy, dtype)


@pytest.mark.parametrize("act", ["", "swish"])
@pytest.mark.parametrize("fmt", ["nchw", "nhwc"])
def test_group_norm_split_path(backend_name, monkeypatch, fmt, act):
    """Groups larger than a tile: statistics merged across programs (forced with small tiles)."""
    from apex._kernels import group_norm as kernels

    monkeypatch.setitem(kernels.LIMITS, "tile", 128)
    monkeypatch.setitem(kernels.LIMITS, "fuse_max", 32)
    x, w, b, dy = _inputs((2, 8, 9, 7), torch.float32)
    memfmt = torch.channels_last if fmt == "nhwc" else None
    dy = dy.to(memory_format=memfmt) if memfmt else dy
    with trace(backend_name, x, w, b, dy) as tr:
        y, grads = _run(x, 2, w, b, 1e-5, act, dy, memfmt)
    if tr is not None:
        assert tr.launches == 5  # statistics + apply; backward sums + dx + the parameter gradients' sum
    if memfmt:
        assert y.is_contiguous(memory_format=memfmt) and grads[0].is_contiguous(memory_format=memfmt)
    _check(y, grads, x, 2, w, b, 1e-5, act == "swish", dy, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_group_norm_nhwc_with_fp32_parameters(backend_name, dtype):
    x, w, b, dy = _inputs((2, 16, 5, 6), dtype, wdtype=torch.float32)
    cl = torch.channels_last
    with trace(backend_name, x, w, b, dy):
        y, grads = _run(x, 4, w, b, 1e-5, "silu", dy.to(memory_format=cl), cl)
    assert y.dtype == dtype and y.is_contiguous(memory_format=cl)
    assert grads[0].dtype == dtype and grads[1].dtype == torch.float32
    ref_y, ref_g = _ref(x, 4, w, b, 1e-5, True, dy)
    tol = 2 * 2 ** -8 if dtype == torch.bfloat16 else 2e-3
    assert_rel_close(y, ref_y, dtype, tol=tol)
    assert_rel_close(grads[0], ref_g[0], dtype, tol=tol)
    assert_rel_close(list(grads[1:]), list(ref_g[1:]), tol=1e-5)


def test_group_norm_no_affine_and_non_contiguous(backend_name):
    x = torch.randn(3, 12, 10, 9)[:, :, 1:9, ::2]
    dy = torch.randn(x.shape)
    assert not x.is_contiguous()
    with trace(backend_name, x, dy):
        y, grads = _run(x, 3, None, None, 1e-5, "silu", dy)
    _check(y, grads, x, 3, None, None, 1e-5, True, dy, torch.float32)


def test_group_norm_apex_entry_points(backend_name):
    import group_norm_cuda

    x, w, b, dy = _inputs((2, 8, 4, 5), torch.float16, wdtype=torch.float32)
    x = x.to(memory_format=torch.channels_last)
    y, sums = group_norm_cuda.forward(x, 4, w.detach(), b.detach(), 1e-5, 1, True)
    assert sums.shape == (2 * 2 * 4,) and sums.dtype == torch.float32
    ref_y, ref_g = _ref(x, 4, w, b, 1e-5, True, dy)
    assert_rel_close(y, ref_y, torch.float16)
    dx, dw, db = group_norm_cuda.backward(dy.to(memory_format=torch.channels_last), sums, x, 4, w.detach(),
                                          b.detach(), 1e-5, 2, True)
    assert_rel_close(dx, ref_g[0], torch.float16)
    assert_rel_close([dw, db], list(ref_g[1:]), tol=1e-5)


@pytest.mark.parametrize("which", ["grad_output", "sums"])
def test_group_norm_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """group_norm_cuda.backward refuses a gradient or statistics on another device than the input (``meta``
    standing in), naming it, before a kernel reads it."""
    import group_norm_cuda

    x = torch.randn(2, 8, 3, 3, device=device)
    w, b = torch.randn(8, device=device), torch.randn(8, device=device)
    _, sums = group_norm_cuda.forward(x, 4, w, b, 1e-5)
    dy = torch.randn(2, 8, 3, 3, device=device)
    if which == "grad_output":
        dy = dy.to("meta")
    else:
        sums = sums.to("meta")
    with pytest.raises(ValueError, match=f"{'grad_output' if which == 'grad_output' else 'mean'} is on meta"):
        group_norm_cuda.backward(dy, sums, x, 4, w, b, 1e-5)


def test_group_norm_bad_input_raises():
    x = torch.randn(2, 6, 4)
    with pytest.raises(ValueError, match="num_groups=4 must divide the number of channels C=6"):
        GN.group_norm(x, 4)
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
        GN.group_norm(x, 0)
    with pytest.raises(ValueError, match=r"weight must have shape \[6\]"):
        GN.group_norm(x, 3, torch.ones(5), torch.zeros(5))
    with pytest.raises(ValueError, match="both be given"):
        GN.group_norm(x, 3, torch.ones(6), None)
    with pytest.raises(ValueError, match="act must be one of"):
        GN.group_norm(x, 3, act="relu")
    with pytest.raises(TypeError, match="floating-point"):
        GN.group_norm(torch.ones(2, 6, dtype=torch.int32), 3)
    with pytest.raises(ValueError, match=r"shape \[N, C, \*spatial\]"):
        GN.group_norm(torch.randn(6), 3)
    with pytest.raises(ValueError, match="grad_output must have the input's shape"):
        GN.group_norm_backward(torch.randn(2, 6), x, torch.zeros(6), torch.ones(6), 3)


def test_group_norm_float64():
    x, w, b, dy = _inputs((2, 6, 7), torch.float64)
    y, grads = _run(x, 3, w, b, 1e-5, "silu", dy)
    ref_y, ref_g = _ref(x, 3, w, b, 1e-5, True, dy)
    assert_rel_close([y] + list(grads), [ref_y] + list(ref_g), tol=1e-12)


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 3), groups=st.integers(1, 4), cg=st.integers(1, 5), h=st.integers(2, 9),
       w=st.integers(1, 9), nhwc=st.booleans(), silu=st.booleans())
def test_group_norm_random_shapes(backend_name, n, groups, cg, h, w, nhwc, silu):
    torch.manual_seed(n * 1000 + groups * 100 + h * 10 + w)
    shape = (n, groups * cg, h, w)
    x, wt, b, dy = _inputs(shape, torch.float32)
    fmt = torch.channels_last if nhwc else None
    with trace(backend_name, x, wt, b, dy):
        y, grads = _run(x, groups, wt, b, 1e-5, "silu" if silu else "", dy, fmt)
    _check(y, grads, x, groups, wt, b, 1e-5, silu, dy, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,groups", SHAPES, ids=str)
def test_group_norm_accurate_torch_path(monkeypatch, shape, groups, dtype):
    """The PyTorch path for large groups (var_mean statistics, centred backward), forced on small shapes."""
    monkeypatch.setattr(GN, "ACCURATE_MIN_GROUP", 0)
    x, w, b, dy = _inputs(shape, dtype)
    with apex.backend("torch"):
        y, grads = _run(x, groups, w, b, 1e-5, "silu", dy, torch.channels_last if len(shape) == 4 else None)
    _check(y, grads, x, groups, w, b, 1e-5, True, dy, dtype)


def test_group_norm_large_offset_group_keeps_fp32_accuracy():
    """PyTorch's CPU GroupNorm is off by ~1e-4 in dweight here (mean −2.3, 2^16+ elements per group)."""
    x = (-2.3 + 0.5 * torch.randn(2, 4, 128, 160)).to(memory_format=torch.channels_last)
    w, b = torch.rand(4).requires_grad_(), torch.rand(4).requires_grad_()
    dy = 0.1 * torch.randn(x.shape)
    with apex.backend("torch"):
        y, grads = _run(x, 1, w, b, 1e-5, "", dy)
    ref_y, ref_g = _ref(x, 1, w, b, 1e-5, False, dy)
    assert_rel_close(y, ref_y, tol=1e-6)
    assert_rel_close(list(grads), list(ref_g), tol=2e-6)


def test_group_norm_nchw_fp32_takes_pytorchs_kernel_and_stays_accurate():
    # Contiguous fp32 input: PyTorch's fused native_group_norm (accurate for NCHW, unlike its channels_last
    # kernel on groups with a large mean; see the test above).
    x = -2.3 + 0.5 * torch.randn(3, 64, 20, 24)
    w, b = torch.rand(64), torch.rand(64)
    with apex.backend("torch"):
        y, mean, rstd = GN.group_norm_forward(x, 8, w, b, 1e-5, "silu")
    ref = F.silu(F.group_norm(x.double(), 8, w.double(), b.double(), 1e-5))
    assert_rel_close(y, ref, tol=1e-6)
    assert mean.dtype == torch.float32 and mean.shape == (3 * 8,) and rstd.shape == (3 * 8,)


def test_triton_launchers_run_no_fill(triton_device, monkeypatch):
    """The launchers issue no PyTorch operator of their own: every program writes its row of the per-slice
    channel sums (no zero-filled buffer) and a kernel sums them into the parameter gradients (no PyTorch
    reduction), except where there is one row (one sample, one slice): that row is the gradient."""
    from apex._backend import interpreting
    from apex._kernels import group_norm as kernels
    from apex.testing import count_eager

    x = torch.randn(2, 64, 4, 4).to(memory_format=torch.channels_last)
    dy = torch.randn(2, 64, 4, 4).to(memory_format=torch.channels_last)
    w, b = torch.randn(64), torch.randn(64)
    _, mean, rstd = kernels.forward(x, 8, w, b, 1e-5, False)

    def own(fn):
        ops = count_eager(fn)["ops"]
        if interpreting():
            ops.pop("copy_", None)  # the interpreter's transfers between tensors and its numpy arrays
        return ops

    zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: pytest.fail("a zero-filled buffer") or zeros(*a, **k))
    assert own(lambda: kernels.forward(x, 8, w, b, 1e-5, False)) == {}
    assert own(lambda: kernels.backward(dy, x, 8, w, b, mean, rstd, False)) == {}
    _, mean1, rstd1 = kernels.forward(x[:1], 8, w, b, 1e-5, False)
    assert own(lambda: kernels.backward(dy[:1], x[:1], 8, w, b, mean1, rstd1, False)) == {}
    for n in (1, 2):  # the gradients those sums give
        _, dw, db = kernels.backward(dy[:n], x[:n], 8, w, b, *kernels.forward(x[:n], 8, w, b, 1e-5, False)[1:],
                                     False)
        w64, b64 = w.double().requires_grad_(), b.double().requires_grad_()
        # (an NCHW reference: PyTorch's CPU channels_last GroupNorm backward crashed on this one-sample slice)
        ref = torch.autograd.grad(F.group_norm(x[:n].double().contiguous(), 8, w64, b64, 1e-5), (w64, b64),
                                  dy[:n].double().contiguous())
        assert_rel_close([dw, db], list(ref), tol=1e-6)
