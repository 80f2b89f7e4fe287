"""apex.ops.rms_norm: outputs and gradients against a float64 reference on both backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex._kernels import _tuning
from apex.ops import rms_norm as R
from apex.testing import assert_rel_close
from tests.ops._norms import DTYPES, GRAD_LAYOUTS, SHAPES, grad_like, run, trace


def _weight(ns, dtype, affine=True):
    # Away from zero: the memory-efficient backward divides by the weight.
    return (1.0 + 0.25 * torch.randn(ns)).to(dtype).requires_grad_() if affine else None


def _rms64(x, ns, w, eps):
    dims = tuple(range(-len(ns), 0))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y * w if w is not None else y


def _ref(x, ns, w, dy, eps):
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_() if w is not None else None
    y = _rms64(x64, ns, w64, eps)
    return y, torch.autograd.grad(y, [x64] + ([w64] if w is not None else []), dy.double())


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,ns", SHAPES, ids=str)
def test_rms_norm_matches_float64(backend_name, shape, ns, dtype, mem_eff):
    eps = 1e-5
    x = torch.randn(shape).to(dtype).requires_grad_()
    w = _weight(ns, dtype)
    dy = torch.randn(shape).to(dtype)
    with trace(backend_name, x, w, dy) as tr:
        y, grads = run(lambda: R.rms_norm(x, ns, w, eps, mem_eff), x, w, dy)
    if tr is not None:
        assert tr.launches == 3  # forward, backward, dweight reduction
    ref_y, ref_g = _ref(x, ns, w, dy, eps)
    assert y.dtype == dtype and [g.dtype for g in grads] == [dtype] * 2
    # With one element per row, PyTorch's dx ∝ 1 − x̂² cancels catastrophically; ours is w·dy·eps·rstd³
    # (test_rms_norm_one_element_rows_keep_fp32_accuracy holds it to 1e-5 alone).
    by, bg = run(lambda: F.rms_norm(x, ns, w, eps), x, w, dy)
    tol = 1e-5 if dtype == torch.float32 else None
    assert_rel_close(y, ref_y, dtype, tol=tol, baseline=by, name="y")
    assert_rel_close(list(grads), list(ref_g), dtype, tol=tol, baseline=list(bg), name="grads")


@pytest.mark.parametrize("mem_eff", [False, True])
def test_rms_norm_no_affine(backend_name, mem_eff):
    x = torch.randn(9, 33, requires_grad=True)
    dy = torch.randn(9, 33)
    with trace(backend_name, x, dy) as tr:
        y, (dx,) = run(lambda: R.rms_norm(x, (33,), None, 1e-5, mem_eff), x, None, dy)
    if tr is not None:
        assert tr.launches == 2
    ref_y, (ref_dx,) = _ref(x, (33,), None, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(dx, ref_dx, tol=1e-5)


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
def test_rms_norm_non_contiguous(backend_name, layout):
    x = torch.randn(11, 160)[:, 10:110] if layout == "row_strided" else torch.randn(100, 11).t()
    x.requires_grad_()
    w = _weight((100,), torch.float32)
    dy = torch.randn(22, 100)[::2]
    assert not x.is_contiguous() and not dy.is_contiguous()
    with trace(backend_name, x, w, dy):
        y, grads = run(lambda: R.rms_norm(x, (100,), w, 1e-5), x, w, dy)
    ref_y, ref_g = _ref(x, (100,), w, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(list(grads), list(ref_g), tol=1e-5)


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
def test_rms_norm_gradient_layouts(backend_name, layout, mem_eff):
    # A 3-D input (saved as is, its rows taken in the backward) and gradients of every layout.
    x = torch.randn(3, 1, 40, requires_grad=True)
    w = _weight((40,), torch.float32)
    dy = grad_like(layout)
    with trace(backend_name, x, w, dy):
        y, grads = run(lambda: R.rms_norm(x, (40,), w, 1e-5, mem_eff), x, w, dy)
    ref_y, ref_g = _ref(x, (40,), w, dy, 1e-5)
    assert grads[0].shape == x.shape
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(list(grads), list(ref_g), tol=1e-5)


def test_rms_norm_mixed_dtypes(backend_name):
    x = torch.randn(13, 257).to(torch.bfloat16).requires_grad_()
    w = _weight((257,), torch.float32)
    dy = torch.randn(13, 257)
    with trace(backend_name, x, w, dy):
        y, (dx, dw) = run(lambda: R.rms_norm(x, (257,), w, 1e-5, out_dtype=torch.float32), x, w, dy)
    assert y.dtype == torch.float32 and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    ref_y, (ref_dx, ref_dw) = _ref(x, (257,), w, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(dx, ref_dx, torch.bfloat16)
    assert_rel_close(dw, ref_dw, tol=1e-5)


@pytest.mark.parametrize("shape", [(3, 65536), (1000, 3)], ids=str)
def test_rms_norm_wide_row_and_many_rows(backend_name, shape):
    x = torch.randn(shape, requires_grad=True)
    w = _weight(shape[-1:], torch.float32)
    dy = torch.randn(shape)
    with trace(backend_name, x, w, dy):
        y, grads = run(lambda: R.rms_norm(x, shape[-1:], w, 1e-5), x, w, dy)
    ref_y, ref_g = _ref(x, shape[-1:], w, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(list(grads), list(ref_g), tol=1e-5)


def test_rms_norm_very_long_rows_keep_fp32_accuracy():
    """PyTorch's CPU vector_norm of a 1M-element row is off by about 1e-5; the statistics stay near 1e-7."""
    shape = (2, 1_000_003)
    x = (torch.randn(shape) + 0.3).requires_grad_()
    w = _weight(shape[-1:], torch.float32)
    dy = torch.randn(shape)
    with apex.backend("torch"):
        y, grads = run(lambda: R.rms_norm(x, shape[-1:], w, 1e-5), x, w, dy)
    ref_y, ref_g = _ref(x, shape[-1:], w, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-6)
    assert_rel_close(list(grads), list(ref_g), tol=1e-6)


def test_rms_norm_entry_points_match_apex_signatures(backend_name):
    import fused_layer_norm_cuda as ext

    x = torch.randn(5, 2, 12)
    w = _weight((2, 12), torch.float32).detach()
    dy = torch.randn(5, 2, 12)
    out, invvar = ext.rms_forward_affine(x, [2, 12], w, 1e-5)
    assert invvar.shape == (5,)
    ref_y, ref_g = _ref(x, (2, 12), w, dy, 1e-5)
    assert_rel_close(out, ref_y, tol=1e-5)
    assert_rel_close(invvar, torch.rsqrt(x.double().pow(2).mean((1, 2)) + 1e-5), tol=1e-5)
    for mem_eff, saved in [(False, x), (True, out)]:
        gi, gw = ext.rms_backward_affine(dy, invvar, saved, [2, 12], w, 1e-5, mem_eff)
        assert_rel_close([gi, gw], list(ref_g), tol=1e-5)
    out2, invvar2 = ext.rms_forward(x, [2, 12], 1e-5)
    ref_y2, (ref_dx2,) = _ref(x, (2, 12), None, dy, 1e-5)
    assert_rel_close(out2, ref_y2, tol=1e-5)
    assert_rel_close(ext.rms_backward(dy, invvar2, x, [2, 12], 1e-5), ref_dx2, tol=1e-5)
    out3, _ = ext.rms_forward_affine_mixed_dtypes(x.to(torch.bfloat16), [2, 12], w, 1e-5)
    assert out3.dtype == torch.float32
    assert_rel_close(out3, _rms64(x.to(torch.bfloat16).double(), (2, 12), w.double(), 1e-5), tol=1e-5)


@pytest.mark.parametrize("which", ["grad_output", "rstd"])
def test_rms_norm_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """fused_layer_norm_cuda's RMS backward refuses a gradient or statistic on another device than the saved
    input (``meta`` standing in), naming it, before a kernel reads it."""
    import fused_layer_norm_cuda as ext

    x, w = torch.randn(5, 12, device=device), torch.randn(12, device=device)
    _, rstd = ext.rms_forward_affine(x, [12], w, 1e-5)
    args = {"grad_output": torch.randn(5, 12, device=device), "rstd": rstd}
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        ext.rms_backward_affine(args["grad_output"], args["rstd"], x, [12], w, 1e-5, False)


def test_rms_norm_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"\[\*, 2, 4\]"):
        R.rms_norm(x, (2, 4))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        R.rms_norm(x, (8,), torch.ones(2, 4))
    with pytest.raises(TypeError, match="floating-point"):
        R.rms_norm(torch.ones(4, 8, dtype=torch.int32), (8,))
    with pytest.raises(TypeError, match="normalized_shape"):
        R.rms_norm(x, "8")
    with pytest.raises(ValueError, match="is on meta"):
        R.rms_norm(x, (8,), torch.ones(8, device="meta"))


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), n=st.integers(2, 300), affine=st.booleans())
def test_rms_norm_random_shapes(backend_name, rows, n, affine):
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, requires_grad=True)
    w = _weight((n,), torch.float32, affine)
    dy = torch.randn(rows, n)
    with trace(backend_name, x, w, dy):
        y, grads = run(lambda: R.rms_norm(x, (n,), w, 1e-5), x, w, dy)
    ref_y, ref_g = _ref(x, (n,), w, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(list(grads), list(ref_g), tol=1e-5)


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_rms_norm_one_element_rows_keep_fp32_accuracy(backend_name, eps, mem_eff):
    # One element per row: dx = w·dy·(1 − x̂²)·rstd, and x̂² = x²/(x² + eps) is 1 to within eps/x², so
    # that form keeps only about log10(x²/eps) fewer digits than fp32 has (1.4e-2 relative on a GPU, where
    # the rounding of rstd differs from the interpreter's). 1 − x̂² is eps·rstd², exactly: the kernels must
    # use it. Checked at the fp32 bound, without PyTorch's own (cancelled) result as an allowance; every
    # |x| in [1, 2], so that no row's (larger) gradient hides the others in the relative error.
    x = ((1 + torch.rand(257, 1)) * torch.randn(257, 1).sign()).requires_grad_()
    w = _weight((1,), torch.float32)
    dy = torch.randn(257, 1)
    y, grads = run(lambda: R.rms_norm(x, (1,), w, eps, mem_eff), x, w, dy)
    ref_y, ref_g = _ref(x, (1,), w, dy, eps)
    assert_rel_close(y, ref_y, tol=1e-5, name="y")
    assert_rel_close(list(grads), list(ref_g), tol=1e-5, name="grads")
    # Apex's entry point takes epsilon too.
    out, invvar = R.rms_forward_affine(x.detach(), (1,), w.detach(), eps)
    dx, dw = R.rms_backward_affine(dy, invvar, out if mem_eff else x.detach(), (1,), w.detach(), eps, mem_eff)
    assert_rel_close([dx, dw], list(ref_g), tol=1e-5, name="rms_backward_affine")


# ------------------------------------------------------------------------ the column-chunked backward (_norm_wide)
# As test_layer_norm's: 65 x 200 rows in 4 chunks of 64 columns (the last 8 wide) by 33 tiles of 2 rows (the last
# of one), walked by 17 row groups of 2 tiles but the last, of one.
_WIDE = {"split": 64, "rows": 2, "warps": 1, "programs_per_sm": 1}
_M, _N = 65, 200


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_rms_norm_wide_backward_matches_float64(triton_device, dtype, mem_eff):
    x = torch.randn(_M, _N).to(dtype).requires_grad_()
    w = _weight((_N,), dtype)
    dy = torch.randn(_M, _N).to(dtype)
    with apex.backend("triton"):
        with trace("triton", x, w, dy) as tr, _tuning.override("rms_norm.bwd", **_WIDE):
            y, grads = run(lambda: R.rms_norm(x, (_N,), w, 1e-5, mem_eff), x, w, dy)
        one_pass = run(lambda: R.rms_norm(x, (_N,), w, 1e-5, mem_eff), x, w, dy)[1]
    if tr is not None:  # forward, row statistics, dx and partial sums, their reduction
        assert dict(tr.kernels) == {"_fwd_kernel": 1, "_bwd_stats_kernel": 1, "_bwd_split_kernel": 1,
                                    "_reduce_kernel": 1}, dict(tr.kernels)
    _, ref_g = _ref(x, (_N,), w, dy, 1e-5)
    assert [g.dtype for g in grads] == [dtype] * 2
    tol = 1e-5 if dtype == torch.float32 else None
    assert_rel_close(list(grads), list(ref_g), dtype, tol=tol, name="grads")
    # The one-pass kernel's numerics, its sums in another order: a few output roundings apart at most (one
    # bf16 rounding of one element is ~3e-5 of the norm here).
    assert_rel_close(list(grads), [g.double() for g in one_pass], tol=1e-6 if dtype == torch.float32 else 5e-4,
                     name="vs one-pass")


@pytest.mark.parametrize("mem_eff", [False, True])
def test_triton_rms_norm_wide_backward_without_weight(triton_device, mem_eff):
    x = torch.randn(_M, _N, requires_grad=True)
    dy = torch.randn(_M, _N)
    with apex.backend("triton"), trace("triton", x, dy), _tuning.override("rms_norm.bwd", **_WIDE):
        y, (dx,) = run(lambda: R.rms_norm(x, (_N,), None, 1e-5, mem_eff), x, None, dy)
    ref_y, (ref_dx,) = _ref(x, (_N,), None, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5, name="y")
    assert_rel_close(dx, ref_dx, tol=1e-5, name="dx")


@pytest.mark.parametrize("mem_eff", [False, True])
def test_triton_fused_add_rms_norm_wide_backward(triton_device, mem_eff):
    """The residual's gradient ``dh`` added to dx in the same pass (fused add + RMSNorm)."""
    from apex.normalization import fused_add_rms_norm

    x, res = torch.randn(_M, _N, requires_grad=True), torch.randn(_M, _N, requires_grad=True)
    w = _weight((_N,), torch.float32)
    dy, dh = torch.randn(_M, _N), torch.randn(_M, _N)
    with apex.backend("triton"), trace("triton", x, res, w, dy, dh) as tr, \
            _tuning.override("rms_norm.bwd", **_WIDE):
        y, h = fused_add_rms_norm(x, res, w, (_N,), 1e-5, mem_eff)
        grads = torch.autograd.grad([y, h], [x, res, w], [dy, dh])
    if tr is not None:
        assert tr.kernels["_bwd_split_kernel"] == 1, dict(tr.kernels)
    l64 = [t.detach().double().requires_grad_() for t in (x, res, w)]
    h64 = l64[0] + l64[1]
    g64 = torch.autograd.grad([_rms64(h64, (_N,), l64[2], 1e-5), h64], l64, [dy.double(), dh.double()])
    assert_rel_close(list(grads), list(g64), tol=1e-5, name="grads")


def test_triton_rms_norm_wide_backward_row_strides_and_determinism(triton_device):
    """Gradient, saved input and residual gradient read at their own row strides (the launcher's rows, not
    contiguous copies), the same bits on a second run."""
    from apex._kernels import _norm as K

    x = torch.randn(_M, _N + 24)[:, 5:5 + _N]
    dy = torch.randn(_M, _N + 40)[:, 17:17 + _N]
    dr = torch.randn(_M, _N + 8)[:, 8:]
    assert x.stride(0) != _N and dy.stride(0) != _N and dr.stride(0) != _N
    w = _weight((_N,), torch.float32).detach()
    _, _, rstd, _ = K.forward(x, w, None, 1e-5, torch.float32, True)
    with apex.backend("triton"), _tuning.override("rms_norm.bwd", **_WIDE):
        first = K.backward(dy, x, w, None, None, rstd, False, True, torch.float32, dr)
        second = K.backward(dy, x, w, None, None, rstd, False, True, torch.float32, dr)
    for a, c in zip(first[:2], second[:2]):
        assert torch.equal(a, c)
    _, (ref_dx, ref_dw) = _ref(x, (_N,), w, dy, 1e-5)
    assert_rel_close(list(first[:2]), [ref_dx + dr.double(), ref_dw], tol=1e-5, name="grads")
