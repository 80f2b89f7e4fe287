"""apex.normalization: Apex's modules, functional forms, autograd Functions and the residual fusions."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.nn.functional as F

import apex
from apex.normalization import (
    FusedLayerNorm,
    FusedLayerNormAffineFunction,
    FusedLayerNormAffineMixedDtypesFunction,
    FusedLayerNormFunction,
    FusedRMSNorm,
    FusedRMSNormAffineFunction,
    FusedRMSNormAffineMixedDtypesFunction,
    FusedRMSNormFunction,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_add_layer_norm,
    fused_add_rms_norm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    manual_rms_norm,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)
from apex.normalization.fused_layer_norm import fused_layer_norm
from apex.testing import TritonTrace, assert_rel_close


def _trace(backend_name):
    return TritonTrace(bounds=True) if backend_name == "triton" else contextlib.nullcontext()


def _rms64(x, ns, w, eps):
    dims = tuple(range(-len(ns), 0))
    y = x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    return y * w if w is not None else y


def _ln64(x, ns, w, b, eps):
    return F.layer_norm(x, ns, w, b, eps)


def _grads(y, leaves, dy):
    return torch.autograd.grad(y, leaves, dy)


def _check_cases(backend_name, cases, leaves, leaves64, dy):
    """Each case is ``(ours, ref, n_leaves)``: the output and the gradients of the first ``n_leaves`` of
    ``leaves`` must match the float64 reference to 1e-5."""
    for ours, ref, n_leaves in cases:
        with _trace(backend_name):
            y = ours()
            g = _grads(y, leaves[:n_leaves], dy)
        r = ref()
        assert_rel_close(y, r, tol=1e-5)
        assert_rel_close(list(g), list(_grads(r, leaves64[:n_leaves], dy.double())), tol=1e-5)


# ------------------------------------------------------------------------------------------- modules
def test_module_parameters_reset_and_repr():
    m = FusedLayerNorm(8)
    assert m.normalized_shape == torch.Size([8]) and m.eps == 1e-5 and m.elementwise_affine
    assert torch.equal(m.weight, torch.ones(8)) and torch.equal(m.bias, torch.zeros(8))
    assert set(m.state_dict()) == set(torch.nn.LayerNorm(8).state_dict()) == {"weight", "bias"}
    with torch.no_grad():
        m.weight.mul_(3)
        m.bias.add_(1)
    m.reset_parameters()
    assert torch.equal(m.weight, torch.ones(8)) and torch.equal(m.bias, torch.zeros(8))
    assert m.extra_repr() == "torch.Size([8]), eps=1e-05, elementwise_affine=True"
    m2 = FusedLayerNorm([4, 6], eps=1e-3, elementwise_affine=False, memory_efficient=True)
    assert m2.weight is None and m2.bias is None and m2.memory_efficient
    assert m2.normalized_shape == torch.Size([4, 6]) and "eps=0.001" in repr(m2)
    r = FusedRMSNorm(torch.Size([2, 3]))
    assert torch.equal(r.weight, torch.ones(2, 3)) and set(r.state_dict()) == {"weight"}
    assert r.extra_repr() == "torch.Size([2, 3]), eps=1e-05, elementwise_affine=True"
    assert FusedRMSNorm(5, elementwise_affine=False).weight is None


@pytest.mark.parametrize("cls", [MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_mixed_modules_reject_no_affine(cls):
    with pytest.warns(UserWarning, match="elementwise_affine"):
        m = cls(8, elementwise_affine=True)
    assert m.elementwise_affine and m.weight is not None
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="elementwise_affine = False"):
        cls(8, elementwise_affine=False)
    with pytest.raises(TypeError):
        cls(8, 1e-5, True)  # memory_efficient is keyword-only, as in Apex


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("mem_eff", [False, True])
def test_mixed_module_fp32_weights_bf16_input(backend_name, kind, mem_eff):
    """Megatron-style: fp32 parameters, bf16 activations → fp32 output; gradients in each leaf's dtype."""
    ns = (2, 48)
    m = (MixedFusedLayerNorm(ns, memory_efficient=mem_eff) if kind == "layer"
         else MixedFusedRMSNorm(ns, memory_efficient=mem_eff))
    with torch.no_grad():
        m.weight.copy_(1 + 0.25 * torch.randn(ns))
        if kind == "layer":
            m.bias.copy_(0.25 * torch.randn(ns))
    x = torch.randn(5, 3, *ns).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(5, 3, *ns)
    leaves = [x] + list(m.parameters())
    with _trace(backend_name):
        y = m(x)
        grads = _grads(y, leaves, dy)
    assert y.dtype == torch.float32
    assert [g.dtype for g in grads] == [torch.bfloat16] + [torch.float32] * (len(leaves) - 1)
    x64 = x.detach().double().requires_grad_()
    p64 = [p.detach().double().requires_grad_() for p in m.parameters()]
    ref = _ln64(x64, ns, *p64, 1e-5) if kind == "layer" else _rms64(x64, ns, p64[0], 1e-5)
    ref_g = _grads(ref, [x64] + p64, dy.double())
    assert_rel_close(y, ref, tol=1e-5)
    assert_rel_close(grads[0], ref_g[0], torch.bfloat16)
    assert_rel_close(list(grads[1:]), list(ref_g[1:]), tol=1e-5)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plain_module_keeps_input_dtype(backend_name, cls, dtype):
    m = cls(64).to(dtype)
    x = torch.randn(6, 64).to(dtype)
    with _trace(backend_name):
        y = m(x)
    assert y.dtype == dtype
    ref = _ln64(x.double(), (64,), None, None, 1e-5) if cls is FusedLayerNorm else _rms64(x.double(), (64,),
                                                                                           None, 1e-5)
    assert_rel_close(y, ref, dtype, tol=1e-5 if dtype == torch.float32 else None)


@pytest.mark.parametrize("cls", [FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm])
def test_module_uses_a_parametrized_weight(backend_name, device, cls):
    """The modules read their registered parameters without nn.Module.__getattr__; a weight replaced by a
    parametrization (no longer a registered parameter) is still the one used, with its gradient."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    m = cls(16).to(device)
    parametrize.register_parametrization(m, "weight", Double())
    original = m.parametrizations.weight.original
    x = torch.randn(4, 16, device=device, requires_grad=True)
    with _trace(backend_name):
        y = m(x)
        (gw,) = _grads(y, [original], torch.ones_like(y))
    x64, w64 = x.detach().double(), (2 * original).detach().double().requires_grad_()
    b64 = m.bias.detach().double() if getattr(m, "bias", None) is not None else None
    ref = _ln64(x64, (16,), w64, b64, 1e-5) if cls in (FusedLayerNorm, MixedFusedLayerNorm) else \
        _rms64(x64, (16,), w64, 1e-5)
    assert_rel_close(y, ref, tol=1e-5)
    assert_rel_close(gw, 2 * _grads(ref, [w64], torch.ones_like(ref))[0], tol=1e-5)


def test_module_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[\*, 8\]"):
        FusedLayerNorm(8)(torch.randn(3, 7))
    with pytest.raises(TypeError, match="floating-point"):
        FusedRMSNorm(8)(torch.ones(3, 8, dtype=torch.long))
    # ... which are also the RuntimeError that Apex's kernels (and F.layer_norm) raise for them
    with pytest.raises(RuntimeError):
        FusedLayerNorm(8)(torch.randn(3, 7))
    with pytest.raises(RuntimeError):
        FusedLayerNorm(8)(torch.ones(3, 8, dtype=torch.long))
    with pytest.raises(RuntimeError):
        fused_rms_norm_affine(torch.randn(2, 8), torch.ones(7), (8,))
    with pytest.raises(TypeError, match="normalized_shape"):
        FusedLayerNorm("8")


# -------------------------------------------------------------------------------- functional forms
def test_functional_signatures_match_apex():
    for fn, params in [
        (fused_layer_norm_affine, ["input", "weight", "bias", "normalized_shape", "eps", "memory_efficient"]),
        (fused_layer_norm, ["input", "normalized_shape", "eps", "memory_efficient"]),
        (mixed_dtype_fused_layer_norm_affine,
         ["input", "weight", "bias", "normalized_shape", "eps", "memory_efficient"]),
        (fused_rms_norm_affine, ["input", "weight", "normalized_shape", "eps", "memory_efficient"]),
        (fused_rms_norm, ["input", "normalized_shape", "eps", "memory_efficient"]),
        (mixed_dtype_fused_rms_norm_affine,
         ["input", "weight", "normalized_shape", "eps", "memory_efficient"]),
    ]:
        sig = inspect.signature(fn)
        assert list(sig.parameters) == params, fn.__name__
        assert sig.parameters["eps"].default == 1e-6 and sig.parameters["memory_efficient"].default is False
    manual = list(inspect.signature(manual_rms_norm).parameters)
    assert manual == ["input", "normalized_shape", "weight", "eps"]


def test_functional_forms_match_float64(backend_name):
    x = torch.randn(4, 3, 10, requires_grad=True)
    w = (1 + 0.25 * torch.randn(10)).requires_grad_()
    b = (0.25 * torch.randn(10)).requires_grad_()
    dy = torch.randn(4, 3, 10)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    cases = [
        (lambda: fused_layer_norm_affine(x, w, b, [10]), lambda: _ln64(x64, (10,), w64, b64, 1e-6), 3),
        (lambda: fused_layer_norm(x, 10), lambda: _ln64(x64, (10,), None, None, 1e-6), 1),
        (lambda: mixed_dtype_fused_layer_norm_affine(x, w, b, (10,), 1e-6, True),
         lambda: _ln64(x64, (10,), w64, b64, 1e-6), 3),
        (lambda: fused_rms_norm_affine(x, w, (10,)), lambda: _rms64(x64, (10,), w64, 1e-6), 2),
        (lambda: fused_rms_norm(x, (10,), 1e-6, True), lambda: _rms64(x64, (10,), None, 1e-6), 1),
        (lambda: mixed_dtype_fused_rms_norm_affine(x, w, (10,)), lambda: _rms64(x64, (10,), w64, 1e-6), 2),
    ]
    _check_cases(backend_name, cases, [x, w, b], [x64, w64, b64], dy)


def test_manual_rms_norm_follows_apex():
    x = torch.randn(3, 4, 5).to(torch.bfloat16)
    w16 = torch.ones(4, 5, dtype=torch.bfloat16)
    assert manual_rms_norm(x, (4, 5), w16, 1e-6).dtype == torch.bfloat16
    y = manual_rms_norm(x, [4, 5], torch.ones(4, 5), 1e-6)
    assert y.dtype == torch.float32
    assert_rel_close(y, _rms64(x.double(), (4, 5), None, 1e-6), tol=1e-5)
    assert manual_rms_norm(x, (5,), None, 1e-6).dtype == torch.float32


def test_autocast_casts_arguments_like_apex():
    """Under autocast the functional forms cast every floating argument to the autocast dtype."""
    m = FusedLayerNorm(16)
    r = MixedFusedRMSNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        z = r(x)
    assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16
    (y.float().sum() + z.float().sum()).backward()
    assert m.weight.grad.dtype == torch.float32 and r.weight.grad.dtype == torch.float32
    assert x.grad.dtype == torch.float32
    assert_rel_close(y, _ln64(x.detach().double(), (16,), None, None, 1e-5), torch.bfloat16)


# ------------------------------------------------------------------------------- autograd Functions
@pytest.mark.parametrize("mem_eff", [False, True])
def test_autograd_functions_apex_argument_order(backend_name, mem_eff):
    x = torch.randn(6, 2, 8, requires_grad=True)
    w = (1 + 0.25 * torch.randn(2, 8)).requires_grad_()
    b = (0.25 * torch.randn(2, 8)).requires_grad_()
    dy = torch.randn(6, 2, 8)
    ns = (2, 8)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    cases = [
        (lambda: FusedLayerNormAffineFunction.apply(x, w, b, ns, 1e-5, mem_eff),
         lambda: _ln64(x64, ns, w64, b64, 1e-5), 3),
        (lambda: FusedLayerNormAffineMixedDtypesFunction.apply(x, w, b, ns, 1e-5, mem_eff),
         lambda: _ln64(x64, ns, w64, b64, 1e-5), 3),
        (lambda: FusedLayerNormFunction.apply(x, ns, 1e-5, mem_eff),
         lambda: _ln64(x64, ns, None, None, 1e-5), 1),
        (lambda: FusedRMSNormAffineFunction.apply(x, w, ns, 1e-5, mem_eff),
         lambda: _rms64(x64, ns, w64, 1e-5), 2),
        (lambda: FusedRMSNormAffineMixedDtypesFunction.apply(x, w, ns, 1e-5, mem_eff),
         lambda: _rms64(x64, ns, w64, 1e-5), 2),
        (lambda: FusedRMSNormFunction.apply(x, ns, 1e-5, mem_eff), lambda: _rms64(x64, ns, None, 1e-5), 1),
    ]
    _check_cases(backend_name, cases, [x, w, b], [x64, w64, b64], dy)
    # Defaults: memory_efficient may be left out, as Apex's callers do.
    assert FusedRMSNormFunction.apply(x, ns, 1e-5).shape == x.shape
    xb = x.detach().to(torch.bfloat16)
    assert FusedLayerNormAffineMixedDtypesFunction.apply(xb, w, b, ns, 1e-5).dtype == torch.float32
    assert FusedRMSNormAffineMixedDtypesFunction.apply(xb, w, ns, 1e-5).dtype == torch.float32
    assert FusedRMSNormAffineFunction.apply(xb, w.to(torch.bfloat16), ns, 1e-5).dtype == torch.bfloat16


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_layer_norm_functions_backward_in_half_precision(backend_name, dtype, mem_eff):
    """Megatron calls the autograd Functions (and ``fused_layer_norm_cuda``) with half inputs and
    weights: the gradients are within twice PyTorch's own error in that dtype."""
    import fused_layer_norm_cuda as ext

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 40, generator=gen).to(dtype).requires_grad_()
    w = (1 + 0.25 * torch.randn(40, generator=gen)).to(dtype).requires_grad_()
    b = (0.25 * torch.randn(40, generator=gen)).to(dtype).requires_grad_()
    dy = torch.randn(6, 40, generator=gen).to(dtype)
    ns = torch.Size([40])
    leaves = [x, w, b]
    with _trace(backend_name):
        y = FusedLayerNormAffineFunction.apply(x, w, b, ns, 1e-5, mem_eff)
        grads = _grads(y, leaves, dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in leaves)
    ref = _ln64(x64, ns, w64, b64, 1e-5)
    ref_grads = _grads(ref, [x64, w64, b64], dy.double())
    xs, ws, bs = (t.detach().clone().requires_grad_() for t in leaves)
    base = F.layer_norm(xs, ns, ws, bs, 1e-5)
    base_grads = _grads(base, [xs, ws, bs], dy)
    assert y.dtype == dtype and [g.dtype for g in grads] == [dtype] * 3
    assert_rel_close(y, ref, baseline=base)
    assert_rel_close(list(grads), list(ref_grads), baseline=list(base_grads))
    with _trace(backend_name):
        y2 = FusedLayerNormFunction.apply(x, ns, 1e-5, mem_eff)
        (gx,) = _grads(y2, [x], dy)
    (ref_gx,) = _grads(_ln64(x64, ns, None, None, 1e-5), [x64], dy.double())
    (base_gx,) = _grads(F.layer_norm(xs, ns, None, None, 1e-5), [xs], dy)
    assert_rel_close(gx, ref_gx, baseline=base_gx)
    # The extension's entry points, as Apex's C++ module takes them.
    with torch.no_grad(), _trace(backend_name):
        out, mean, invvar = ext.forward_affine(x, ns, w, b, 1e-5)
        assert mean.dtype == invvar.dtype == torch.float32
        gi, gw, gb = ext.backward_affine(dy, mean, invvar, x, ns, w, b, 1e-5, False)
    assert_rel_close([gi, gw, gb], list(ref_grads), baseline=list(base_grads))


# ---------------------------------------------------------------------------------- residual fusion
@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)], ids=str)
def test_fused_add_norm(backend_name, kind, dtypes, mem_eff):
    x_dtype, r_dtype = dtypes
    ns = (3, 40)
    x = torch.randn(7, *ns).to(x_dtype).requires_grad_()
    res = torch.randn(7, *ns).to(r_dtype).requires_grad_()
    w = (1 + 0.25 * torch.randn(ns)).requires_grad_()
    b = (0.25 * torch.randn(ns)).requires_grad_()
    dy, dh = torch.randn(7, *ns).to(x_dtype), torch.randn(7, *ns)
    leaves = [x, res, w] + ([b] if kind == "layer" else [])
    with _trace(backend_name) as tr:
        if kind == "rms":
            y, h = fused_add_rms_norm(x, res, w, ns, 1e-5, mem_eff)
        else:
            y, h = fused_add_layer_norm(x, res, w, b, ns, 1e-5, mem_eff)
        grads = torch.autograd.grad([y, h], leaves, [dy, dh])
    if tr is not None:
        assert tr.launches == 3  # forward, backward (+ dh), parameter-gradient reduction
    assert y.dtype == x_dtype and h.dtype == r_dtype
    assert [g.dtype for g in grads] == [t.dtype for t in leaves]
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    h64 = l64[0] + l64[1]
    y64 = _rms64(h64, ns, l64[2], 1e-5) if kind == "rms" else _ln64(h64, ns, l64[2], l64[3], 1e-5)
    g64 = torch.autograd.grad([y64, h64], l64, [dy.double(), dh.double()])
    assert_rel_close(h, h64, r_dtype)
    assert_rel_close(y, y64, x_dtype, tol=1e-5 if x_dtype == torch.float32 else None)
    for g, r, t in zip(grads, g64, leaves):
        # Memory-efficient gradients come from x̂ rebuilt from y, so they are as precise as y's dtype.
        dt = x_dtype if mem_eff else t.dtype
        assert_rel_close(g, r, dt, tol=1e-5 if dt == torch.float32 else None)


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fused_add_norm_gradient_layouts(backend_name, kind, mem_eff):
    """Gradients of y and h that are not contiguous (an expanded one, one with a gap between rows) and a
    contiguous one with an odd size-1 stride, on a 3-D input: the backward reads each at its own row stride."""
    ns = (40,)
    x, res = torch.randn(3, 1, 40).requires_grad_(), torch.randn(3, 1, 40).requires_grad_()
    w, b = (1 + 0.25 * torch.randn(ns)).requires_grad_(), (0.25 * torch.randn(ns)).requires_grad_()
    leaves = [x, res, w] + ([b] if kind == "layer" else [])
    for dy, dh in [(torch.randn(1, 1, 40).expand(3, 1, 40), torch.randn(3, 1, 50)[..., :40]),
                   (torch.randn(3, 1, 50)[..., :40], torch.randn(3, 40).as_strided((3, 1, 40), (40, 7, 1)))]:
        with _trace(backend_name):
            y, h = fused_add_rms_norm(x, res, w, ns, 1e-5, mem_eff) if kind == "rms" else \
                fused_add_layer_norm(x, res, w, b, ns, 1e-5, mem_eff)
            grads = torch.autograd.grad([y, h], leaves, [dy, dh])
        l64 = [t.detach().double().requires_grad_() for t in leaves]
        h64 = l64[0] + l64[1]
        y64 = _rms64(h64, ns, l64[2], 1e-5) if kind == "rms" else _ln64(h64, ns, l64[2], l64[3], 1e-5)
        g64 = torch.autograd.grad([y64, h64], l64, [dy.double(), dh.double()])
        assert grads[0].shape == x.shape
        assert_rel_close(list(grads), list(g64), torch.float32, tol=1e-5)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_fused_add_norm_output_alone_in_the_loss(backend_name, kind):
    """Only ``y`` reaches the loss (a pre-norm block's usual call): the gradient of ``h`` is None, which the
    Triton backward adds as nothing; a forward without gradients returns the same ``y`` and ``h``."""
    ns = (64,)
    x, res = torch.randn(5, 64).requires_grad_(), torch.randn(5, 64).requires_grad_()
    w, b = (1 + 0.25 * torch.randn(ns)).requires_grad_(), (0.25 * torch.randn(ns)).requires_grad_()
    dy = torch.randn(5, 64)
    leaves = [x, res, w] + ([b] if kind == "layer" else [])

    def run(*ts):
        return fused_add_rms_norm(ts[0], ts[1], ts[2], ns, 1e-5) if kind == "rms" else \
            fused_add_layer_norm(ts[0], ts[1], ts[2], ts[3], ns, 1e-5)
    with _trace(backend_name) as tr:
        y, h = run(*leaves)
        grads = torch.autograd.grad(y, leaves, dy)
        with torch.no_grad():
            y_ng, h_ng = run(*leaves)
    if tr is not None:
        assert tr.launches == 4
    l64 = [t.detach().double().requires_grad_() for t in leaves]
    h64 = l64[0] + l64[1]
    y64 = _rms64(h64, ns, l64[2], 1e-5) if kind == "rms" else _ln64(h64, ns, l64[2], l64[3], 1e-5)
    g64 = torch.autograd.grad(y64, l64, dy.double())
    assert_rel_close(list(grads), list(g64), torch.float32, tol=1e-5)
    assert_rel_close([y_ng, h_ng], [y64, h64], torch.float32, tol=1e-5)


def test_fused_add_rejects_mismatched_residual():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="residual must have the input's shape"):
        fused_add_rms_norm(x, torch.randn(3, 9), None, (8,))
    with pytest.raises(TypeError, match="residual"):
        fused_add_layer_norm(x, torch.ones(3, 8, dtype=torch.int32), None, None, (8,))


def test_lazy_public_surface():
    assert apex.normalization.FusedLayerNorm is FusedLayerNorm
    import fused_layer_norm_cuda as ext

    for name in ("forward", "forward_affine", "forward_affine_mixed_dtypes", "backward", "backward_affine",
                 "rms_forward", "rms_forward_affine", "rms_forward_affine_mixed_dtypes", "rms_backward",
                 "rms_backward_affine"):
        assert callable(getattr(ext, name)), name
    with pytest.raises(AttributeError):
        ext.no_such_entry  # noqa: B018


def test_bf16_layer_norm_on_cpu_is_correctly_rounded():
    # Upstream's test_layer_norm_bfloat16 compares our bf16 output with an fp32-input reference at
    # atol 3e-4: for some seeds one element differs by more, from the input's own bf16 rounding. The output
    # here is the float64 layer norm of the bf16 input rounded once, which no implementation can beat.
    from apex.normalization import FusedLayerNorm

    src = torch.randn(48, 160, 48)
    xb = src.to(torch.bfloat16)[::3, ::5, ::3]  # upstream's non-contiguous case
    m = FusedLayerNorm([32, 16]).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(torch.randn(32, 16))
        m.bias.copy_(torch.randn(32, 16))
    with apex.backend("torch"):
        y = m(xb)
    ideal = torch.nn.functional.layer_norm(xb.double(), [32, 16], m.weight.double(), m.bias.double())
    ulp = torch.finfo(torch.bfloat16).eps * ideal.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    # the affine step rounds once more in bf16 (Apex's kernel does the same): half an ulp each way
    assert ((y.double() - ideal).abs() <= ulp).all()
    y_plain = FusedLayerNorm([32, 16], elementwise_affine=False).to(torch.bfloat16)(xb)
    assert torch.equal(y_plain, torch.nn.functional.layer_norm(xb.double(), [32, 16]).to(torch.bfloat16))


def test_fused_layer_norm_names_the_submodule_as_in_apex():
    """Apex's package exports only the modules' classes, so ``apex.normalization.fused_layer_norm`` is the
    submodule (client code reaches its classes, functions and registered ops through it)."""
    import types

    import apex.normalization

    sub = apex.normalization.fused_layer_norm
    assert isinstance(sub, types.ModuleType)
    assert sub.FusedLayerNorm is apex.normalization.FusedLayerNorm
    assert callable(sub.fused_layer_norm) and callable(sub.fused_rms_norm_affine_fwd)
