"""Apex's registered ops of apex.normalization.fused_layer_norm (``apex::fused_layer_norm_affine_fwd`` and the
other seven): names, schemas, values and statistics against float64, gradients through the ``_fwd`` ops'
autograd, the ``_bwd`` ops called directly, ``memory_efficient``, ``opcheck``, ``torch.compile`` and errors."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch._library.infer_schema import infer_schema

from apex.testing import assert_rel_close

# The module itself: the package's attribute of that name is the functional form fused_layer_norm.
FLN = importlib.import_module("apex.normalization.fused_layer_norm")

OPS = ("fused_layer_norm_affine_fwd", "fused_layer_norm_affine_bwd", "fused_layer_norm_fwd", "fused_layer_norm_bwd",
       "fused_rms_norm_affine_fwd", "fused_rms_norm_affine_bwd", "fused_rms_norm_fwd", "fused_rms_norm_bwd")
KINDS = ("layer_affine", "layer", "rms_affine", "rms")
SHAPE, NORM = (3, 5, 2, 24), [2, 24]  # two normalised dims: rows of 48
EPS = 1e-5


def _ref(kind, x, w, b, eps=EPS):
    """float64 ``(output, mean or None, invvar)`` with one statistic per row."""
    x = x.double()
    dims = tuple(range(-len(NORM), 0))
    if kind.startswith("layer"):
        mean = x.mean(dims, keepdim=True)
        invvar = torch.rsqrt((x - mean).square().mean(dims, keepdim=True) + eps)
        y = (x - mean) * invvar
    else:
        mean = None
        invvar = torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)
        y = x * invvar
    if w is not None:
        y = y * w.double()
    if b is not None:
        y = y + b.double()
    return y, None if mean is None else mean.reshape(-1), invvar.reshape(-1)


def _torch_same_dtype(kind, x, w, b):
    """PyTorch's own computation in the input dtype: the baseline of the half-precision bounds."""
    if kind.startswith("layer"):
        return F.layer_norm(x, NORM, w, b, EPS)
    return F.rms_norm(x, NORM, w, EPS)


def _params(kind, dtype, device, requires_grad=False):
    w = (1 + 0.5 * torch.randn(NORM, device=device)).to(dtype).requires_grad_(requires_grad)
    b = (0.5 * torch.randn(NORM, device=device)).to(dtype).requires_grad_(requires_grad)
    return (w if kind.endswith("affine") else None), (b if kind == "layer_affine" else None)


def _fwd(kind, x, w, b, memory_efficient=False):
    """The kind's ``_fwd`` op through the module's name: ``(output, mean or None, invvar)``."""
    if kind == "layer_affine":
        return FLN.fused_layer_norm_affine_fwd(x, w, b, NORM, EPS, memory_efficient)
    if kind == "layer":
        return FLN.fused_layer_norm_fwd(x, NORM, EPS, memory_efficient)
    if kind == "rms_affine":
        y, invvar = FLN.fused_rms_norm_affine_fwd(x, w, NORM, EPS, memory_efficient)
    else:
        y, invvar = FLN.fused_rms_norm_fwd(x, NORM, EPS, memory_efficient)
    return y, None, invvar


def test_apex_names_schemas_and_globals():
    assert FLN.supports_custom_op() is True
    assert "fused_layer_norm_cuda" in vars(FLN)
    for name in OPS:
        fake = getattr(FLN, name + "_fake")
        # The schema custom_op infers from Apex's signature (the fake's): graphs name the same op.
        expected = f"apex::{name}{infer_schema(fake, mutates_args=())}"
        assert str(getattr(torch.ops.apex, name).default._schema) == expected
        assert callable(getattr(FLN, name))
    x = torch.randn(2, 8)
    FLN.fused_rms_norm_fwd(x, [8], EPS)
    assert FLN.fused_layer_norm_cuda is importlib.import_module("fused_layer_norm_cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_forward_ops_match_float64(backend_name, device, kind, dtype):
    x = (torch.randn(SHAPE, device=device) * 2 + 0.5).to(dtype)
    w, b = _params(kind, dtype, device)
    y, mean, invvar = _fwd(kind, x, w, b)
    y_ref, mean_ref, invvar_ref = _ref(kind, x, w, b)
    assert y.dtype == dtype and y.shape == x.shape and y.device == x.device
    baseline = None if dtype == torch.float32 else _torch_same_dtype(kind, x, w, b)
    assert_rel_close(y, y_ref, baseline=baseline)
    # Statistics as Apex's extension returns them: one per row, fp32 for half inputs.
    rows = SHAPE[0] * SHAPE[1]
    for stat, ref in ((mean, mean_ref), (invvar, invvar_ref)):
        if ref is None:
            continue
        assert stat.shape == (rows,) and stat.dtype == torch.float32
        assert_rel_close(stat, ref, tol=2e-6)


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", KINDS)
def test_fwd_op_gradients_of_every_input(backend_name, device, kind, dtype, memory_efficient):
    x = (torch.randn(SHAPE, device=device) + 0.3).to(dtype).requires_grad_()
    w, b = _params(kind, dtype, device, requires_grad=True)
    leaves = [t for t in (x, w, b) if t is not None]
    g = torch.randn(SHAPE, device=device).to(dtype)
    y, mean, invvar = _fwd(kind, x, w, b, memory_efficient)
    assert not invvar.requires_grad  # statistics: no gradient flows through them
    grads = torch.autograd.grad(y, leaves, g)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, w64, b64 = (*leaves64, None, None)[:3]  # absent parameters last
    ref = torch.autograd.grad(_ref(kind, x64, w64, b64)[0], leaves64, g.double())
    baseline = None
    if dtype != torch.float32:
        leaves_t = [t.detach().clone().requires_grad_() for t in leaves]
        xt, wt, bt = (*leaves_t, None, None)[:3]
        baseline = torch.autograd.grad(_torch_same_dtype(kind, xt, wt, bt), leaves_t, g)
    assert_rel_close(list(grads), list(ref), dtype, baseline=baseline, name="grads")
    for grad, leaf in zip(grads, leaves):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape


@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_input(backend_name, device, kind):
    """A transposed input (Apex's ops make it contiguous first): values and gradients as for a copy."""
    x = torch.randn(48, 3, 5, device=device).permute(1, 2, 0).reshape(3, 5, 2, 24).requires_grad_()
    assert not x.is_contiguous()
    w, b = _params(kind, torch.float32, device, requires_grad=True)
    leaves = [t for t in (x, w, b) if t is not None]
    y = _fwd(kind, x, w, b)[0]
    assert y.is_contiguous()
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    y_ref = _ref(kind, *(*leaves64, None, None)[:3])[0]
    assert_rel_close(y, y_ref)
    g = torch.randn(SHAPE, device=device)
    assert_rel_close(list(torch.autograd.grad(y, leaves, g)), list(torch.autograd.grad(y_ref, leaves64, g.double())),
                     torch.float32, name="grads")


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_bwd_ops_called_directly(backend_name, device, kind, memory_efficient):
    """Apex's ``_bwd`` contract: the forward's statistics and its input, or its output when memory_efficient
    (then the mean is not read: None is accepted)."""
    x = torch.randn(SHAPE, device=device) + 0.3
    w, b = _params(kind, torch.float32, device)
    g = torch.randn(SHAPE, device=device)
    y, mean, invvar = _fwd(kind, x, w, b)
    v = y if memory_efficient else x
    if kind == "layer_affine":
        got = FLN.fused_layer_norm_affine_bwd(g, None if memory_efficient else mean, invvar, v, NORM, w, b, EPS,
                                              memory_efficient)
    elif kind == "layer":
        got = (FLN.fused_layer_norm_bwd(g, None if memory_efficient else mean, invvar, v, NORM, EPS,
                                        memory_efficient),)
    elif kind == "rms_affine":
        got = FLN.fused_rms_norm_affine_bwd(g, invvar, v, NORM, w, EPS, memory_efficient)
    else:
        got = (FLN.fused_rms_norm_bwd(g, invvar, v, NORM, EPS, memory_efficient),)
    leaves64 = [t.double().requires_grad_() for t in (x, w, b) if t is not None]
    x64, w64, b64 = (*leaves64, None, None)[:3]  # absent parameters last
    ref = torch.autograd.grad(_ref(kind, x64, w64, b64)[0], leaves64, g.double())
    assert_rel_close(list(got), list(ref), tol=1e-5 if memory_efficient else 2e-6, name="grads")


@pytest.mark.parametrize("kind", KINDS)
def test_memory_efficient_saves_the_output_not_the_input(kind):
    x = torch.randn(4, 2, 24, requires_grad=True)
    w, b = _params(kind, torch.float32, "cpu", requires_grad=True)
    saved: list = []
    for memory_efficient in (False, True):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = _fwd(kind, x, w, b, memory_efficient)[0]
        ptrs = {t.data_ptr() for t in saved}
        assert (y.data_ptr() in ptrs) is memory_efficient
        assert (x.data_ptr() in ptrs) is not memory_efficient


def _op_args(kind, x, w, b, memory_efficient):
    """``[(op, args)]``: the kind's ``_fwd`` op and its ``_bwd`` op on the forward's results."""
    with torch.no_grad():
        y, mean, invvar = _fwd(kind, x, w, b)
    g = torch.randn_like(x)
    v = (y if memory_efficient else x).detach()
    ops = torch.ops.apex
    if kind == "layer_affine":
        return [(ops.fused_layer_norm_affine_fwd.default, (x, w, b, NORM, EPS, memory_efficient)),
                (ops.fused_layer_norm_affine_bwd.default, (g, mean, invvar, v, NORM, w.detach(), b.detach(), EPS,
                                                           memory_efficient))]
    if kind == "layer":
        return [(ops.fused_layer_norm_fwd.default, (x, NORM, EPS, memory_efficient)),
                (ops.fused_layer_norm_bwd.default, (g, mean, invvar, v, NORM, EPS, memory_efficient))]
    if kind == "rms_affine":
        return [(ops.fused_rms_norm_affine_fwd.default, (x, w, NORM, EPS, memory_efficient)),
                (ops.fused_rms_norm_affine_bwd.default, (g, invvar, v, NORM, w.detach(), EPS, memory_efficient))]
    return [(ops.fused_rms_norm_fwd.default, (x, NORM, EPS, memory_efficient)),
            (ops.fused_rms_norm_bwd.default, (g, invvar, v, NORM, EPS, memory_efficient))]


@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_opcheck(kind, memory_efficient):
    """Schema, autograd registration, fake tensors and AOT dispatch (dynamic shapes) of every op, on CPU."""
    x = torch.randn(3, 2, 24, requires_grad=True)
    w, b = _params(kind, torch.float32, "cpu", requires_grad=True)
    for op, args in _op_args(kind, x, w, b, memory_efficient):
        result = torch.library.opcheck(op, args)
        assert set(result.values()) == {"SUCCESS"}, (op, result)


@pytest.mark.parametrize("kind", KINDS)
def test_compile_fullgraph_records_the_ops(backend_name, device, kind):
    """torch.compile(fullgraph=True) of a call and its backward: the graph holds the apex op, the values and
    gradients are eager's."""
    torch._dynamo.reset()
    x = torch.randn(4, 2, 24, device=device, requires_grad=True)
    w, b = _params(kind, torch.float32, device, requires_grad=True)
    leaves = [t for t in (x, w, b) if t is not None]
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x):
        y, _, invvar = _fwd(kind, x, w, b, kind.startswith("rms"))
        return y.square().sum() + invvar.sum().detach()

    out = torch.compile(step, fullgraph=True, backend=record)(x)
    grads = torch.autograd.grad(out, leaves)
    ref_out = step(x)
    ref = torch.autograd.grad(ref_out, leaves)
    assert_rel_close(out, ref_out, tol=1e-6)
    assert_rel_close(list(grads), list(ref), tol=1e-6)
    fwd_name = {"layer_affine": "fused_layer_norm_affine_fwd", "layer": "fused_layer_norm_fwd",
                "rms_affine": "fused_rms_norm_affine_fwd", "rms": "fused_rms_norm_fwd"}[kind]
    targets = {str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert any(fwd_name in t for t in targets), targets


def test_bad_arguments_raise_as_apex():
    x = torch.randn(4, 24)
    w = torch.ones(24)
    # Apex's extension checks with TORCH_CHECK: RuntimeError, here naming the argument.
    with pytest.raises(RuntimeError, match="normalized_shape"):
        FLN.fused_layer_norm_fwd(x, [16], EPS)
    with pytest.raises(RuntimeError, match="weight"):
        FLN.fused_rms_norm_affine_fwd(x, torch.ones(16), [24], EPS)
    with pytest.raises(RuntimeError, match="bias"):
        FLN.fused_layer_norm_affine_fwd(x, w, torch.zeros(12), [24], EPS)
    with pytest.raises(RuntimeError, match="mean"):  # the non-memory-efficient backward needs the mean
        FLN.fused_layer_norm_bwd(x, None, torch.ones(4), x, [24], EPS, False)
    with pytest.raises(RuntimeError, match="grad_output"):
        FLN.fused_rms_norm_affine_bwd(x[:2], torch.ones(4), x, [24], w, EPS)
    with pytest.raises(RuntimeError):  # the dispatcher's schema check, as for Apex's op
        FLN.fused_rms_norm_fwd([1.0, 2.0], [2], EPS)
    # A _bwd op has no derivative (Apex registers none): its backward raises instead of returning zeros.
    xr = x.clone().requires_grad_()
    y, invvar = FLN.fused_rms_norm_fwd(x, [24], EPS)
    dx = FLN.fused_rms_norm_bwd(torch.ones_like(x), invvar, xr, [24], EPS)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        dx.sum().backward()
