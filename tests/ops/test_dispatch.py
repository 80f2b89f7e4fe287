"""apex.ops._dispatch: eager calls of the custom ops skip torch.library's dispatcher, tracers still see them.

The dispatcher's entries are counted with the autograd profiler, which records every operator the
dispatcher runs by name (``apex::layer_norm_fwd``, ...) and nothing that bypasses it.
"""

from __future__ import annotations

import pytest
import torch

from tests import _device
from tests.ops._modes import Recorder as _Recorder

NEEDS_PLAIN_TENSORS = pytest.mark.skipif(
    _device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops under a dispatch mode, which "
    "takes the registered op by design")


def _apex_ops(fn) -> list[str]:
    """Names of the apex:: operators the dispatcher ran while ``fn()`` ran."""
    with torch.autograd.profiler.profile() as prof:
        fn()
    return sorted({e.name for e in prof.function_events if e.name.startswith("apex::")})


def _layer_norm(dev):
    from apex.normalization import FusedLayerNorm

    mod, x = FusedLayerNorm(16).to(dev), torch.randn(4, 16, device=dev, requires_grad=True)
    return (lambda: mod(x)), (x, mod.weight, mod.bias), "apex::layer_norm_fwd"


def _rms_norm(dev):
    from apex.normalization import FusedRMSNorm

    mod, x = FusedRMSNorm(16).to(dev), torch.randn(4, 16, device=dev, requires_grad=True)
    return (lambda: mod(x)), (x, mod.weight), "apex::rms_norm_fwd"


def _fused_add_rms_norm(dev):
    from apex.normalization import fused_add_rms_norm

    x, r, w = (torch.randn(*s, device=dev, requires_grad=True) for s in ((4, 16), (4, 16), (16,)))
    return (lambda: sum(fused_add_rms_norm(x, r, w, (16,)))), (x, r, w), "apex::fused_add_norm_fwd"


def _fused_rope(dev):
    from apex.transformer.functional import fused_apply_rotary_pos_emb

    t, freqs = torch.randn(4, 2, 2, 8, device=dev, requires_grad=True), torch.randn(4, 1, 1, 8, device=dev)
    return (lambda: fused_apply_rotary_pos_emb(t, freqs)), (t,), "apex::fused_rope"


def _causal_softmax(dev):
    from apex.transformer.functional import scaled_upper_triang_masked_softmax

    x = torch.randn(2, 2, 8, 8, device=dev, requires_grad=True)
    return (lambda: scaled_upper_triang_masked_softmax(x, None, 0.5)), (x,), "apex::scaled_masked_softmax_fwd"


def _bias_swiglu(dev):
    from apex.transformer.functional import bias_swiglu

    x, b = torch.randn(4, 16, device=dev, requires_grad=True), torch.randn(16, device=dev, requires_grad=True)
    return (lambda: bias_swiglu(x, b)), (x, b), "apex::bias_swiglu_fwd"


def _bias_gelu(dev):
    from apex.transformer.functional import bias_gelu

    x, b = torch.randn(4, 16, device=dev, requires_grad=True), torch.randn(16, device=dev, requires_grad=True)
    return (lambda: bias_gelu(x, b)), (x, b), "apex::bias_gelu_fwd"


def _group_norm(dev):
    from apex.ops.group_norm import group_norm

    x = torch.randn(2, 8, 3, 3, device=dev).to(memory_format=torch.channels_last).requires_grad_()
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    return (lambda: group_norm(x, 4, w, b, 1e-5)), (x, w, b), "apex::group_norm_fwd"


OPS = {"layer_norm": _layer_norm, "rms_norm": _rms_norm, "fused_add_rms_norm": _fused_add_rms_norm,
       "fused_rope": _fused_rope, "causal_softmax": _causal_softmax, "bias_swiglu": _bias_swiglu,
       "bias_gelu": _bias_gelu, "group_norm": _group_norm}


@NEEDS_PLAIN_TENSORS
@pytest.mark.parametrize("name", list(OPS))
def test_eager_calls_skip_the_dispatcher(name, triton_device):
    import apex

    call, inputs, op = OPS[name](triton_device)
    with apex.backend("triton"):
        y = call()
        expected = torch.autograd.grad(y.square().sum(), inputs)
        ran = _apex_ops(lambda: torch.autograd.grad(call().square().sum(), inputs))
        assert ran == [], f"eager forward + backward went through the dispatcher: {ran}"
        with torch.no_grad():
            assert _apex_ops(call) == []
        # The same op through the dispatcher (a dispatch mode is active) gives the same values.
        with _Recorder() as rec:
            y2 = call()
            got = torch.autograd.grad(y2.square().sum(), inputs)
        assert op in rec.ops
    torch.testing.assert_close(y2, y, rtol=0, atol=0)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)



def _compiled(call):
    """``(output, targets)``: ``call`` compiled in one graph on the Triton backend, with the graph's node targets."""
    import apex

    seen: list[str] = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    torch._dynamo.reset()
    with apex.backend("triton"):
        y = torch.compile(call, fullgraph=True, backend=backend)()
    torch._dynamo.reset()
    return y, seen


@pytest.mark.parametrize("name", list(OPS))
def test_compile_records_the_custom_op(name, triton_device):
    import apex

    call, inputs, op = OPS[name](triton_device)
    y, seen = _compiled(call)
    with apex.backend("triton"):
        ref = call()
    assert op.replace("::", ".") in seen, seen
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_compile_records_the_custom_op_where_dynamo_folds_is_exporting(name, triton_device, monkeypatch):
    """Dynamo before torch 2.13 folds ``torch.compiler.is_exporting()`` to True under ``torch.compile`` too: a
    compiled norm must still take the registered op (PyTorch's operators are for torch.export alone). The
    patched function stands in for that fold: True while Dynamo traces (it inlines the function), else the
    flag torch.export sets."""
    exporting = torch.compiler.is_exporting
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling() or exporting())
    call, inputs, op = OPS[name](triton_device)
    _, seen = _compiled(call)
    assert op.replace("::", ".") in seen, seen


@NEEDS_PLAIN_TENSORS
def test_in_place_op_bumps_the_version_without_the_dispatcher(triton_device):
    """wgrad_gemm_accum mutates main_grad: the eager path bumps its version counter as the registered op's
    ADInplaceOrView kernel does, so autograd still notices a saved main_grad changed."""
    import apex
    from apex.transformer.functional import wgrad_gemm_accum_fp32

    inp, go = torch.randn(8, 4, device=triton_device), torch.randn(8, 3, device=triton_device)
    main_grad = torch.zeros(3, 4, device=triton_device)
    version = main_grad._version
    with apex.backend("triton"):
        assert _apex_ops(lambda: wgrad_gemm_accum_fp32(inp, go, main_grad)) == []
    assert main_grad._version > version


@NEEDS_PLAIN_TENSORS
def test_unused_outputs_get_zero_gradients(triton_device):
    """The eager path hands the backward None for outputs outside the loss (no zero tensors made); the
    gradients reaching the inputs are what the registered op gave: zeros, not None. The norms' statistics
    (whose gradient the backward ignores) leave the eager path without a grad_fn: differentiating them
    fails instead of giving the registered op's zeros (their true derivative is not zero)."""
    import apex
    from apex.normalization import fused_add_rms_norm
    from apex.ops.layer_norm import _fwd_op

    x = torch.randn(4, 16, device=triton_device, requires_grad=True)
    r = torch.randn(4, 16, device=triton_device, requires_grad=True)
    w = torch.randn(16, device=triton_device, requires_grad=True)
    with apex.backend("triton"):
        y, mean, rstd = _fwd_op(x, w, None, [16], 1e-5, False, torch.float32)
        assert y.grad_fn is not None and mean.grad_fn is None and rstd.grad_fn is None
        ref = torch.ops.apex.layer_norm_fwd(x, w, None, [16], 1e-5, False, torch.float32)
        for a, b in zip((y, mean, rstd), ref, strict=True):
            torch.testing.assert_close(a, b)
        _, h = fused_add_rms_norm(x, r, w, (16,))
        gx, gr, gw = torch.autograd.grad(h.sum(), (x, r, w))
    torch.testing.assert_close(gx, torch.ones_like(x))
    torch.testing.assert_close(gr, torch.ones_like(r))
    assert not gw.any()


@pytest.mark.parametrize("name", ["layer_norm", "rms_norm"])
def test_double_backward_fails_as_before(name, triton_device):
    """A second derivative takes the registered backward op, which has no formula: the same error as
    before the eager path, never a silently wrong value."""
    import apex

    call, inputs, _ = OPS[name](triton_device)
    with apex.backend("triton"):
        (g,) = torch.autograd.grad(call().square().sum(), inputs[:1], create_graph=True)
        with pytest.raises(RuntimeError, match="no autograd formula"):
            g.sum().backward()


@NEEDS_PLAIN_TENSORS
def test_tensor_subclass_argument_takes_the_registered_op(triton_device):
    """A tensor subclass in any tensor argument (here the optional weight, not the first argument) takes the
    registered op, as eager() answers for it."""
    import apex
    from apex.ops.layer_norm import _fwd_op

    x, w = torch.randn(4, 16, device=triton_device), torch.randn(16, device=triton_device)
    with apex.backend("triton"):
        assert _apex_ops(lambda: _fwd_op(x, w, None, [16], 1e-5, False, torch.float32)) == []
        assert _apex_ops(lambda: _fwd_op(x, _Sub(w), None, [16], 1e-5, False, torch.float32)) == \
            ["apex::layer_norm_fwd"]


@NEEDS_PLAIN_TENSORS
@pytest.mark.parametrize("name", ["layer_norm", "rms_norm", "fused_add_rms_norm"])
def test_backward_under_a_dispatch_mode_takes_the_registered_op(name, triton_device):
    """A forward run eagerly (the norms launch their kernels from a plain autograd.Function) whose backward
    runs under a dispatch mode: the mode sees the registered backward op, with the same gradients."""
    import apex

    call, inputs, op = OPS[name](triton_device)
    with apex.backend("triton"):
        expected = torch.autograd.grad(call().square().sum(), inputs)
        loss = call().square().sum()
        with _Recorder() as rec:
            got = torch.autograd.grad(loss, inputs)
    assert op.replace("_fwd", "_bwd") in rec.ops, rec.ops
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@NEEDS_PLAIN_TENSORS
def test_needs_input_grad_is_the_ops_own_in_every_backward(triton_device):
    """The eager Function's own two leading arguments are hidden from the op's backward, which reads
    needs_input_grad (bias-SwiGLU takes dbias from its backward's launch only when the bias needs it),
    in a second backward of a retained graph too."""
    import apex
    from apex.transformer.functional import bias_swiglu

    x = torch.randn(4, 16, device=triton_device, requires_grad=True)
    b = torch.randn(16, device=triton_device)
    with apex.backend("triton"):
        for needs_bias in (True, False):
            b.requires_grad_(needs_bias)
            inputs = (x, b) if needs_bias else (x,)
            y = bias_swiglu(x, b)
            first = torch.autograd.grad(y.sum(), inputs, retain_graph=True)
            second = torch.autograd.grad(y.sum(), inputs)
            assert len(first) == len(inputs)
            torch.testing.assert_close(first, second, rtol=0, atol=0)
    h = (x + b).detach()
    sig = torch.sigmoid(h[:, :8])
    torch.testing.assert_close(first[0][:, :8], sig * (1 + h[:, :8] * (1 - sig)) * h[:, 8:], rtol=1e-5, atol=1e-6)


def test_eager_predicate():
    from apex.ops._dispatch import eager

    x = torch.ones(2)
    assert eager((x, torch.nn.Parameter(x), None, 3, [2]))
    with _Recorder():
        assert not eager((x,))
    assert not eager((_Sub(x),))
    seen = []
    torch.vmap(lambda t: (seen.append(eager((t,))), t)[1])(x)
    assert seen == [False]
    assert torch.compile(lambda t: t + eager((t,)), fullgraph=True, backend="eager")(x).eq(1).all()


class _Sub(torch.Tensor):
    pass


def test_lazy_module_traces_and_compiles_once(tmp_path, monkeypatch):
    # An op compiled before it ever ran eagerly imports its kernels inside the traced call: no graph break
    # there (Dynamo breaks at importlib.import_module), and no second graph once an eager call (a backward,
    # say) has filled the loader's cache.
    import sys

    from apex.ops._dispatch import lazy_module

    name = "apex_lazy_module_probe"
    (tmp_path / f"{name}.py").write_text("SCALE = 3.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    get = lazy_module(name)
    torch._dynamo.reset()
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    @torch.compile(fullgraph=True, backend=backend)
    def f(x):
        return x * get().SCALE

    x = torch.ones(2)
    assert torch.equal(f(x), x * 3)
    assert get().SCALE == 3.0  # an eager call fills the cache
    assert torch.equal(f(x), x * 3) and len(frames) == 1
    torch._dynamo.reset()
