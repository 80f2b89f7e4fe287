"""apex.contrib.openfold_triton.LayerNormSmallShapeOptImpl (apex.ops.openfold_layer_norm) against float64
references on both backends (the Triton path under the interpreter)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.contrib.openfold_triton import (
    LayerNormSmallShapeOptImpl,
)
from apex.testing import assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _torch_layer_norm(x, ns, w, b, eps):
    """F.layer_norm in the tensors' dtypes; with mixed dtypes, which CUDA's kernel refuses, in the promoted
    dtype with the output rounded to the input's (what PyTorch's CPU kernel does for them)."""
    dts = {t.dtype for t in (x, w, b) if t is not None}
    if len(dts) == 1:
        return F.layer_norm(x, ns, w, b, eps)
    ct = torch.float64 if torch.float64 in dts else torch.float32
    cast = (lambda t: t.to(ct) if t is not None else None)
    return F.layer_norm(x.to(ct), ns, cast(w), cast(b), eps).to(x.dtype)


# ------------------------------------------------------------------------------------------ LayerNorm
def _ln_case(x, ns, w, b, dy, eps=1e-5):
    """Our output and grads, the float64 reference, and PyTorch's own result in the input dtype."""
    leaves = [t for t in (x, w, b) if t is not None]
    y = LayerNormSmallShapeOptImpl.apply(x, ns, w, b, eps)
    got = [y, *torch.autograd.grad(y, leaves, dy)]
    d64 = [t.detach().double().requires_grad_() for t in leaves]
    x64, rest = d64[0], iter(d64[1:])
    w64 = next(rest) if w is not None else None
    b64 = next(rest) if b is not None else None
    y64 = F.layer_norm(x64, ns, w64, b64, eps)
    ref = [y64, *torch.autograd.grad(y64, d64, dy.double())]
    yl = _torch_layer_norm(x, ns, w, b, eps)
    base = [yl, *torch.autograd.grad(yl, leaves, dy)]
    return got, ref, base


def _param(n, dtype):
    return (1.0 + 0.3 * torch.randn(n)).to(dtype).requires_grad_()


LN_SHAPES = [
    ((37, 45), (45,), False),          # ragged rows
    ((2, 5, 7, 33), (33,), True),      # OpenFold's transposed 4-D pair activation, read in place
    ((3, 4, 3, 7), (3, 7), False),     # two normalised dims
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,ns,transposed", LN_SHAPES, ids=str)
def test_layer_norm_matches_float64(backend_name, shape, ns, transposed, dtype):
    x = torch.randn(shape)
    if transposed:
        x = x.transpose(1, 2)  # non-contiguous, normalised over the (still unit-stride) last dim
    x = x.to(dtype).requires_grad_()
    w, b = _param(ns, dtype), (0.1 * torch.randn(ns)).to(dtype).requires_grad_()
    dy = torch.randn(x.shape).to(dtype)
    got, ref, base = _ln_case(x, ns, w, b, dy)
    for name, g, r, bl in zip(["y", "dx", "dw", "db"], got, ref, base):
        assert g.dtype == dtype and g.shape == r.shape
        assert_rel_close(g, r, dtype, tol=1e-5 if dtype == torch.float32 else None,
                         baseline=None if dtype == torch.float32 else bl, name=name)


def test_layer_norm_strided_last_dim_and_no_affine(backend_name):
    # A last dim with stride > 1 (4-D) and no weight/bias.
    x = torch.randn(2, 3, 21, 4).transpose(-1, -2).requires_grad_()
    dy = torch.randn(x.shape)
    got, ref, _ = _ln_case(x, (21,), None, None, dy)
    for name, g, r in zip(["y", "dx"], got, ref):
        assert_rel_close(g, r, torch.float32, tol=1e-5, name=name)


def test_layer_norm_bf16_input_fp32_params(backend_name):
    # Mixed precision: bf16 activations, fp32 LayerNorm parameters (their gradients stay fp32).
    x = torch.randn(3, 11, 40).to(torch.bfloat16).requires_grad_()
    w, b = _param(40, torch.float32), torch.randn(40).requires_grad_()
    dy = torch.randn(x.shape).to(torch.bfloat16)
    got, ref, base = _ln_case(x, (40,), w, b, dy)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    for name, g, r, bl in zip(["y", "dx", "dw", "db"], got, ref, base):
        assert_rel_close(g, r, torch.bfloat16, baseline=bl, name=name)


@pytest.fixture
def cuda_dtype_rules(monkeypatch):
    """PyTorch's LayerNorm operators refuse mixed dtypes here as their CUDA kernels do ("expected scalar
    type BFloat16 but found Float"); the CPU kernels accept bf16 activations with fp32 parameters, which
    hid a path that failed on the GPU."""
    def strict(op, x_at, same_at):
        # The CUDA kernels read weight, bias (and the output gradient) as the input's scalar type; the
        # statistics may be fp32.
        def call(*args):
            x = args[x_at]
            for i in same_at:
                if args[i] is not None and args[i].dtype != x.dtype:
                    raise RuntimeError(f"expected scalar type {x.dtype} but found {args[i].dtype} (argument {i}, "
                                       "as CUDA's kernel)")
            return op(*args)
        return call

    monkeypatch.setattr(torch, "native_layer_norm", strict(torch.native_layer_norm, 0, (2, 3)))
    monkeypatch.setattr(torch.ops.aten, "native_layer_norm_backward",
                        strict(torch.ops.aten.native_layer_norm_backward, 1, (0, 5, 6)))


@pytest.mark.parametrize("n", [40, 16385], ids=["kernel-sized", "beyond-MAX_N"])
def test_layer_norm_bf16_input_fp32_params_under_cuda_dtype_rules(backend_name, cuda_dtype_rules, n):
    # Rows beyond MAX_N go to PyTorch's operators on both paths; all rows do on the PyTorch path. With mixed
    # dtypes those must run in one dtype, as they must on a GPU.
    x = torch.randn(3, n).to(torch.bfloat16).requires_grad_()
    w, b = _param(n, torch.float32), torch.randn(n).requires_grad_()
    dy = torch.randn(x.shape).to(torch.bfloat16)
    got, ref, base = _ln_case(x, (n,), w, b, dy)
    assert [g.dtype for g in got] == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    for name, g, r, bl in zip(["y", "dx", "dw", "db"], got, ref, base):
        assert_rel_close(g, r, torch.bfloat16, baseline=bl, name=name)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 70), n=st.integers(3, 130))  # n ≤ 2: dx is 0 up to rounding noise
def test_layer_norm_ragged_shapes_triton(triton_device, m, n):
    # triton_device: on the GPU under APEX_TEST_DEVICE=cuda (the tensors below are made there).
    x = torch.randn(m, n, dtype=torch.float32).requires_grad_()
    w, b = _param(n, torch.float32), torch.randn(n).requires_grad_()
    with apex.backend("triton"):
        got, ref, _ = _ln_case(x, (n,), w, b, torch.randn(m, n))
    for name, g, r in zip(["y", "dx", "dw", "db"], got, ref):
        assert_rel_close(g, r, torch.float32, tol=1e-5, name=name)


def test_layer_norm_bad_arguments_raise():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="normalized_shape"):
        LayerNormSmallShapeOptImpl.apply(x, (7,), None, None, 1e-5)
    with pytest.raises(ValueError, match="weight"):
        LayerNormSmallShapeOptImpl.apply(x, (8,), torch.ones(7), None, 1e-5)
    with pytest.raises(TypeError, match="floating"):
        LayerNormSmallShapeOptImpl.apply(x.long(), (8,), None, None, 1e-5)


@pytest.mark.parametrize("which", ["grad_output", "mean", "rstd"])
def test_layer_norm_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """The backward entry refuses a gradient or statistic on another device than the input (``meta`` standing
    in), naming it, before a kernel reads it."""
    from apex.ops import openfold_layer_norm as OL

    x = torch.randn(6, 8, device=device)
    w, b = torch.randn(8, device=device), torch.randn(8, device=device)
    _, mean, rstd = OL.layer_norm_forward(x, (8,), w, b)
    args = {"grad_output": torch.randn(6, 8, device=device), "mean": mean, "rstd": rstd}
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        OL.layer_norm_backward(args["grad_output"], x, (8,), w, b, args["mean"], args["rstd"])


@pytest.mark.parametrize("grads", ["both", "weight", "bias"])
def test_layer_norm_parameter_gradients_in_one_column_sum(backend_name, grads):
    """dweight and dbias come from one buffer of partial sums and one column-sum launch (three launches
    forward and backward), each in its parameter's dtype, also when only one of them is asked for."""
    from tests.ops._norms import trace

    x = torch.randn(6, 5, 48, requires_grad=True)
    w = (torch.randn(48) + 1).requires_grad_(grads != "bias")
    b = torch.randn(48).half().requires_grad_(grads != "weight")  # a dtype of its own: its gradient's
    dy = torch.randn(6, 5, 48)
    leaves = [t for t in (x, w, b) if t.requires_grad]
    with trace(backend_name, x, w, b) as tr:
        y = LayerNormSmallShapeOptImpl.apply(x, (48,), w, b, 1e-5)
        got = torch.autograd.grad(y, leaves, dy)
    if tr is not None:
        assert tr.launches == 3
    x64, w64, b64 = (t.detach().double().requires_grad_(t.requires_grad) for t in (x, w, b))
    ref = torch.autograd.grad(F.layer_norm(x64, (48,), w64, b64, 1e-5), [t for t in (x64, w64, b64)
                                                                         if t.requires_grad], dy.double())
    for g, r, leaf in zip(got, ref, leaves):
        assert g.dtype == leaf.dtype
        assert_rel_close(g, r, leaf.dtype, tol=1e-5 if leaf.dtype == torch.float32 else 2e-3)


def test_normalized_shape_forms_on_repeated_calls():
    """A normalized_shape tuple of ints is used as given from its second call on (held by identity); other
    forms are converted every call, with the same results and errors."""
    from apex.ops.openfold_layer_norm import check_args

    x = torch.randn(4, 3, 8)
    for ns in ((3, 8), (3.0, 8), [3, 8], torch.Size([3, 8]), 8, (8,)):
        for _ in range(2):
            shape, m, n = check_args(x, ns, None, None)
            assert all(type(s) is int for s in shape) and (m, n) == ((4, 24) if shape == (3, 8) else (12, 8))
    for _ in range(2):
        with pytest.raises(ValueError, match="non-empty suffix"):
            check_args(x, (True, 8), None, None)


def test_layer_norm_without_gradient_records_nothing(backend_name, monkeypatch):
    """With nothing to differentiate (no_grad, or no input requiring grad) ``apply`` runs the forward alone,
    without the autograd Function: the same values, no graph."""
    x, w, b = torch.randn(6, 32), _param(32, torch.float32), torch.randn(32)
    ref = LayerNormSmallShapeOptImpl.apply(x, (32,), w, b, 1e-5).detach()

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(LayerNormSmallShapeOptImpl, "forward", staticmethod(refuse))
    with torch.no_grad():
        y = LayerNormSmallShapeOptImpl.apply(x, (32,), w, b, 1e-5)
    assert y.grad_fn is None and torch.equal(y, ref)
    y = LayerNormSmallShapeOptImpl.apply(x, (32,), w.detach(), b)  # eps defaults to 1e-5
    assert y.grad_fn is None and torch.equal(y, ref)


def test_layer_norm_launches_follow_the_auto_tune_cache(triton_device, monkeypatch):
    """A warm launch takes the config the autotuner's cache holds for its key, also after the cache is
    replaced (loaded, synced, assigned) or edited: the launch plan kept per shape never serves a config the
    cache no longer holds."""
    import triton

    from apex._kernels import _tuning
    from apex._kernels import openfold_layer_norm as kernels

    fwd = kernels._ln_fwd
    if type(fwd.fn).__name__ == "InterpretedFunction" and "run" not in vars(type(fwd.fn)):
        pytest.skip("Triton 3.4's interpreter launches a warm kernel past its run method: nothing to record")
    small, large = triton.Config({"ROWS": 2}, num_warps=1), triton.Config({"ROWS": 8}, num_warps=1)
    taken = []
    run = fwd.fn.run

    def recording(*args, **kwargs):
        grid = kwargs["grid"]
        # ROWS by keyword (the autotuner's launch) or by position (a warm launch passes its constexprs so).
        rows = kwargs["ROWS"] if "ROWS" in kwargs else args[fwd.arg_names.index("ROWS")]
        taken.append((rows, tuple(grid(kwargs) if callable(grid) else grid)))
        return run(*args, **kwargs)

    # Two configs (as on a GPU, where the kernels have many), the cache filled for this shape: no benchmark.
    monkeypatch.setattr(fwd, "configs", [small, large])
    monkeypatch.setattr(fwd, "cache", {})
    monkeypatch.setattr(fwd.fn, "run", recording)
    _tuning.invalidate()
    x, w, b = torch.randn(20, 24), _param(24, torch.float32), torch.randn(24)
    args = (x, w, b, torch.empty(20, 24), torch.empty(20), torch.empty(20), 20, 24)
    key = kernels._autotuner_key(fwd, args + (1, 20, 0, 0, 24, 1, 1e-5))
    ref = F.layer_norm(x.double(), (24,), w.double(), b.double(), 1e-5)
    try:
        with apex.backend("triton"), torch.no_grad():
            for cache, rows in (({key: small}, 2), (None, 2), ({key: large}, 8), ("edit", 2), (None, 2)):
                if cache == "edit":
                    fwd.cache[key] = small
                elif cache is not None:
                    fwd.cache = cache
                y = LayerNormSmallShapeOptImpl.apply(x, (24,), w, b, 1e-5)
                assert taken[-1][0] == rows and taken[-1][1] == (triton.cdiv(20, rows),)
                assert_rel_close(y, ref, torch.float32, tol=1e-5)
    finally:
        _tuning.invalidate()
    assert len(taken) == 5


def test_layer_norm_under_torch_compile():
    """``torch.compile`` of a caller of ``apply`` (whose override Dynamo inlines after a graph break): the
    same values and gradients as eager."""
    x, w = torch.randn(4, 8, requires_grad=True), _param(8, torch.float32)
    fn = torch.compile(lambda x, w: LayerNormSmallShapeOptImpl.apply(x, (8,), w, None, 1e-5), backend="eager")
    y = fn(x, w)
    got = torch.autograd.grad(y, (x, w), torch.ones_like(y))
    y_ref = F.layer_norm(x, (8,), w, None, 1e-5)
    ref = torch.autograd.grad(y_ref, (x, w), torch.ones_like(y_ref))
    for g, r in zip((y, *got), (y_ref, *ref)):
        assert_rel_close(g, r, torch.float32, tol=1e-5)


@pytest.mark.parametrize("backend_choice", ["auto", "triton"])
def test_layer_norm_compiles_in_one_graph(backend_choice):
    """``torch.compile(fullgraph=True)`` of a caller of ``apply`` (CPU tensors: PyTorch's path, as "auto"
    chooses while tracing): no graph break (apex's backend context, a ContextVar, is not read while Dynamo
    traces; the shape cache by ``id()`` is not used there) and the same values and gradients as float64."""
    x = torch.randn(6, 64, requires_grad=True)
    w, b = _param(64, torch.float32), _param(64, torch.float32)
    fn = torch.compile(lambda x, w, b: LayerNormSmallShapeOptImpl.apply(x, (64,), w, b, 1e-5), fullgraph=True,
                       backend="eager")
    with apex.backend(backend_choice):
        y = fn(x, w, b)
    dy = torch.randn(6, 64)
    got = [y, *torch.autograd.grad(y, (x, w, b), dy)]
    d64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y64 = F.layer_norm(d64[0], (64,), d64[1], d64[2], 1e-5)
    ref = [y64, *torch.autograd.grad(y64, d64, dy.double())]
    for g, r in zip(got, ref):
        assert_rel_close(g, r, torch.float32, tol=1e-5)


def test_layer_norm_launch_options_only_where_not_default(monkeypatch):
    """A kept GPU launch passes only the config's options that differ from Triton's defaults (4 warps, 1 CTA,
    the backend's stages; each keyword costs every launch): a config's 8 warps or 2 stages on CUDA are kept."""
    from apex._kernels import openfold_layer_norm as kernels

    monkeypatch.setattr(kernels, "_INTERP", False)
    monkeypatch.setattr(kernels, "_default_stages", lambda: 3)
    assert kernels._launch_options({"num_warps": 4, "num_ctas": 1, "num_stages": 3}) == {}
    assert kernels._launch_options({"num_warps": 8, "num_ctas": 1, "num_stages": 2}) == {"num_warps": 8,
                                                                                           "num_stages": 2}
    monkeypatch.setattr(kernels, "_INTERP", True)
    assert kernels._launch_options({"num_warps": 8, "num_ctas": 1, "num_stages": 2}) == {}
