"""The planned eager Triton path of layer_norm and rms_norm (apex.ops._norm_direct): the same bits as the general
path for every layout it plans, a new plan wherever a fact the checks or launches read changes (a parameter's
``.data`` swapped too), the general path's errors after a warm call, and the general path under compile-time
machinery (dispatch modes, torch.func, saved-tensor hooks that change a layout, double backward)."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.normalization import fused_layer_norm as FLN
from apex.ops import layer_norm as L
from apex.ops import rms_norm as R
from tests import _device
from tests.ops._lean import same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")

LEAN = "_DirectNormBackward"


def _ln(x, shape, w, b, eps=1e-5, me=False, out_dtype=None):
    return L.layer_norm(x, shape, w, b, eps, me, out_dtype)


def _rms(x, shape, w, b, eps=1e-5, me=False, out_dtype=None):
    return R.rms_norm(x, shape, w, eps, me, out_dtype)


OPS = {"layer_norm": (L, _ln), "rms_norm": (R, _rms)}


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)


def _run(fn, x, shape, w, b, dy, **kw):
    """Output and the gradients of every leaf that requires one."""
    y = fn(x, shape, w, b, **kw)
    leaves = [t for t in (x, w, b if fn is _ln else None) if t is not None and t.requires_grad]  # (RMS: no b)
    grads = list(torch.autograd.grad(y, leaves, dy)) if leaves and y.requires_grad else []
    return y, grads


def _both(monkeypatch, mod, fn, x, shape, w, b, dy, **kw):
    """``(lean, general)``: the call on the planned path, then with the plan lookup switched off."""
    lean = _run(fn, _leaf(x), shape, _leaf(w), _leaf(b), dy, **kw)
    with monkeypatch.context() as m:
        m.setattr(mod, "_lean", lambda *args: None)
        general = _run(fn, _leaf(x), shape, _leaf(w), _leaf(b), dy, **kw)
    return lean, general


def _same(a, b):
    same_run(a, b)


def _layout(kind, shape, dtype, dev):
    """An input of ``shape``: contiguous, every other row of a taller tensor, or the leading columns of a wider
    one (rows that are still a view), or transposed (rows that are a copy: not planned)."""
    if kind == "contiguous":
        return torch.randn(shape, device=dev).to(dtype)
    if kind == "row-strided":
        return torch.randn(shape[0] * 2, *shape[1:], device=dev).to(dtype)[::2]
    if kind == "transposed":
        return torch.randn(shape[::-1], device=dev).to(dtype).t()
    return torch.randn(*shape[:-1], shape[-1] * 2, device=dev).to(dtype)[..., :shape[-1]]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind,shape,ns", [("contiguous", (6, 10), (10,)), ("contiguous", (2, 3, 10), (10,)),
                                           ("contiguous", (3, 4, 6), (4, 6)), ("row-strided", (6, 10), (10,)),
                                           ("sliced", (3, 4, 10), (10,))], ids=str)
@pytest.mark.parametrize("params", ["grad", "no-grad", "none"])
@pytest.mark.parametrize("me", [False, True], ids=["saved-input", "memory-efficient"])
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, op, dtype, kind, shape, ns,
                                                       params, me):
    mod, fn = OPS[op]
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit: fresh values each time
            x = _layout(kind, shape, dtype, triton_device).requires_grad_()
            w = (torch.rand(ns, device=triton_device) + 0.5).to(dtype).requires_grad_(params == "grad")
            b = torch.randn(ns, device=triton_device).to(dtype).requires_grad_(params == "grad")
            w, b = (None, None) if params == "none" else (w, b)
            dy = torch.randn(shape, device=triton_device).to(dtype)
            lean, general = _both(monkeypatch, mod, fn, x, ns, w, b, dy, me=me)
            assert type(lean[0].grad_fn).__name__ == LEAN
            _same(lean, general)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("me", [False, True])
def test_mixed_dtypes_match(triton_device, monkeypatch, op, me):
    """The Mixed* variants' call: half input, fp32 parameters, the output in the parameters' dtype."""
    mod, fn = OPS[op]
    dev = triton_device
    with apex.backend("triton"):
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(5, 12, device=dev).to(dtype).requires_grad_()
            w = (torch.rand(12, device=dev) + 0.5).requires_grad_()
            b = torch.randn(12, device=dev, requires_grad=True)
            dy = torch.randn(5, 12, device=dev)
            for _ in range(2):
                lean, general = _both(monkeypatch, mod, fn, x, (12,), w, b, dy, me=me, out_dtype=torch.float32)
                assert type(lean[0].grad_fn).__name__ == LEAN and lean[0].dtype == torch.float32
                _same(lean, general)


@pytest.mark.parametrize("op", OPS)
def test_a_changed_fact_takes_another_plan(triton_device, monkeypatch, op):
    """After a warm call, each change of a fact the checks or launches read gives the general path's values."""
    mod, fn = OPS[op]
    dev = triton_device
    base = torch.randn(8, 12, device=dev)

    def variants():
        yield base, (12,), torch.randn(12, device=dev), torch.randn(12, device=dev)
        yield torch.randn(5, 12, device=dev), (12,), torch.randn(12, device=dev), torch.randn(12, device=dev)
        yield torch.randn(8, 20, device=dev), [20], torch.randn(20, device=dev), torch.randn(20, device=dev)
        yield base.half(), 12, torch.randn(12, device=dev).half(), torch.randn(12, device=dev).half()
        yield base.bfloat16(), (12,), torch.randn(12, device=dev), torch.randn(12, device=dev)  # fp32 params
        yield torch.randn(16, 12, device=dev)[::2], (12,), torch.randn(12, device=dev), None  # a row stride
        yield base.view(2, 4, 12), (12,), None, torch.randn(12, device=dev)
        yield base.view(2, 4, 12), (4, 12), torch.randn(4, 12, device=dev), torch.randn(4, 12, device=dev)
        yield base, torch.Size([12]), torch.randn(24, device=dev)[::2], torch.randn(12, device=dev)  # copied w

    plans = mod._lean.__self__.table.plans
    plans.clear()
    with apex.backend("triton"):
        for x, ns, w, b in variants():
            for xg, wg in ((True, True), (True, False), (False, True)):
                xx, ww = x.detach().requires_grad_(xg), None if w is None else w.detach().requires_grad_(wg)
                bb = None if b is None else b.detach().requires_grad_(wg)
                dy = torch.randn(x.shape, device=dev).to(x.dtype)
                _same(*_both(monkeypatch, mod, fn, xx, ns, ww, bb, dy))
            with torch.no_grad():  # no graph: the plan's forward alone
                lean = fn(x, ns, w, b)
            with monkeypatch.context() as m:
                m.setattr(mod, "_lean", lambda *args: None)
                torch.testing.assert_close(lean, fn(x, ns, w, b), rtol=0, atol=0)
    assert sum(1 for p in plans.values() if p) >= 8


@pytest.mark.parametrize("module", ["FusedLayerNorm", "FusedRMSNorm"])
def test_a_parameters_data_swapped_in_place_is_read_again(triton_device, monkeypatch, module):
    """``param.data = ...`` changes a parameter's dtype or shape without changing the parameter: the next call
    is planned (or refused) for its new facts."""
    dev = triton_device
    m = getattr(FLN, module)(12).to(dev)
    x = torch.randn(4, 12, device=dev, requires_grad=True)
    with apex.backend("triton"):
        m(x)
        m(x)
        m.weight.data = m.weight.data.half()  # now a half weight with an fp32 input: another plan
        y = m(x)
        assert type(y.grad_fn).__name__ == LEAN
        with monkeypatch.context() as mp:
            mp.setattr(FLN, "_ln_lean" if module == "FusedLayerNorm" else "_rms_lean", lambda *args: None)
            torch.testing.assert_close(y, m(x), rtol=0, atol=0)
        m.weight.data = torch.ones(6, device=dev)  # the wrong shape: the general path's error
        with pytest.raises(ValueError, match="weight must have shape"):
            m(x)


@pytest.mark.parametrize("op", OPS)
def test_the_module_takes_the_lean_path(triton_device, monkeypatch, op):
    dev = triton_device
    m = (FLN.FusedLayerNorm if op == "layer_norm" else FLN.FusedRMSNorm)(16).to(dev)
    x = torch.randn(3, 16, device=dev, requires_grad=True)
    calls = []
    real = m.forward.__globals__["_ln_lean" if op == "layer_norm" else "_rms_lean"]

    def counting(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(FLN, "_ln_lean" if op == "layer_norm" else "_rms_lean", counting)
    with apex.backend("triton"):
        y = m(x)
        y2 = m(x)
    assert calls == [True, True] and type(y2.grad_fn).__name__ == LEAN
    torch.testing.assert_close(y, y2, rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_unplanned_layouts_take_the_general_path(triton_device, op):
    """fp64 (the PyTorch path), an empty input and rows that are no view of the input are kept as False."""
    mod, fn = OPS[op]
    plans = mod._lean.__self__.table.plans
    dev = triton_device
    with apex.backend("triton"):
        for x in (torch.randn(4, 6, dtype=torch.float64, device=dev), torch.randn(0, 6, device=dev),
                  torch.randn(6, 4, device=dev).t()):  # [4, 6] transposed: its rows are a copy
            x.requires_grad_()
            y = fn(x, (6,), None, None)
            assert type(y.grad_fn).__name__ != LEAN
            key = (x.shape, x.is_contiguous() or x.stride(), x.dtype,
                   x.get_device() if x.is_cuda or x.is_cpu else x.device, (6,), None)
            assert plans[key] is False


@pytest.mark.parametrize("op", OPS)
def test_a_bad_call_after_a_warm_one_still_raises(triton_device, op):
    mod, fn = OPS[op]
    dev = triton_device
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    with apex.backend("triton"):
        fn(x, (8,), w, b)
        fn(x, (8,), w, b)  # a hit
        with pytest.raises(ValueError, match="weight must have shape"):
            fn(x, (8,), torch.randn(6, device=dev), b)
        with pytest.raises(TypeError, match="weight must be a floating-point tensor"):
            fn(x, (8,), torch.ones(8, dtype=torch.int64, device=dev), b)
        with pytest.raises(ValueError, match="weight is on meta"):
            fn(x, (8,), torch.randn(8, device="meta"), b)
        with pytest.raises(TypeError, match="input must be a floating-point tensor"):
            fn(torch.ones(4, 8, dtype=torch.int64, device=dev), (8,), None, None)
        with pytest.raises(ValueError, match="expects an input of shape"):
            fn(x, (6,), None, None)
        with pytest.raises(TypeError, match="normalized_shape must be an int or a sequence of ints"):
            fn(x, (8.0,), w, b)  # 8.0 == 8 and hashes as 8: never a key
        with pytest.raises(TypeError, match="input must be a torch.Tensor"):
            fn("x", (8,), None, None)
        if op == "layer_norm":
            with pytest.raises(ValueError, match="bias must have shape"):
                fn(x, (8,), w, torch.randn(6, device=dev))
        y = fn(x, (8,), w, b)  # the plan is still there, and right
        assert type(y.grad_fn).__name__ == LEAN


@pytest.mark.parametrize("op", OPS)
def test_a_call_with_the_last_calls_facts_takes_its_plan_on_the_guard(triton_device, monkeypatch, op):
    """A call whose tensors have the last call's metadata (the plan's guard) and the same options takes the plan
    without its key; any other takes the key (and is right): other strides, requires_grad, a parameter's
    ``.data`` swapped, a parameter dropped, ``normalized_shape`` as an equal list or an unequal one."""
    from apex.ops import _norm_direct as D

    mod, fn = OPS[op]
    dev = triton_device
    keyed = []
    exact = D._exact_shape
    monkeypatch.setattr(D, "_exact_shape", lambda s: keyed.append(s) or exact(s))
    ns = (8,)
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    dy = torch.randn(4, 8, device=dev)

    def check(x, ns, w, b, guarded):
        del keyed[:]
        lean, general = _both(monkeypatch, mod, fn, x, ns, w, b, dy)
        _same(lean, general)
        assert (not keyed) == guarded, (keyed, guarded)

    with apex.backend("triton"):
        fn(x, ns, w, b)
        check(x, ns, w, b, True)
        check(torch.randn(4, 8, device=dev, requires_grad=True), ns, w, b, True)  # new tensors, same facts
        check(torch.randn(8, 4, device=dev).t().requires_grad_(), ns, w, b, False)  # other strides
        check(x.detach(), ns, w, b, False)  # no gradient: a second guard of the plan
        check(x, ns, w, b, True)  # ...and both kept: training and evaluation alternately take the plan
        check(x.detach(), ns, w, b, True)
        w2 = w.detach().clone().requires_grad_()
        w2.data = w2.data.half()
        check(x, ns, w2, b, False)
        check(x, ns, None, b, False)
        check(x, [8], w, b, False)
        with pytest.raises(ValueError, match="expects an input of shape"):
            fn(x, (6,), w, b)


@pytest.mark.parametrize("op", OPS)
def test_backward_of_a_saved_input_with_other_strides(triton_device, op):
    """A saved-tensor hook that gives the input back in another layout: the general backward reads it."""
    mod, fn = OPS[op]
    dev = triton_device
    x, w = torch.randn(6, 10, device=dev, requires_grad=True), torch.randn(10, device=dev, requires_grad=True)
    b = torch.randn(10, device=dev, requires_grad=True)
    dy = torch.randn(6, 10, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(fn(x, (10,), w, b), (x, w), dy)

    def pack(t):
        return t.detach().t().contiguous().t() if t.dim() == 2 else t  # a column-major copy

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, (10,), w, b)
    assert type(y.grad_fn).__name__ == LEAN
    with apex.backend("triton"):
        got = torch.autograd.grad(y, (x, w), dy)
    for p, q in zip(got, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("op", OPS)
def test_modes_and_transforms_take_the_general_path(triton_device, op):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    mod, fn = OPS[op]
    dev = triton_device
    x, w = torch.randn(4, 8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    with apex.backend("triton"):
        ref = fn(x, (8,), w, None)
        assert type(ref.grad_fn).__name__ == LEAN
        with Passthrough():
            y = fn(x, (8,), w, None)
        assert type(y.grad_fn).__name__ != LEAN
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        seen = []

        def f(t):  # under a torch.func transform the lean path declines (the general path's op is the one)
            seen.append(mod._lean(t, (8,), w.detach(), None, 1e-5, False, None))
            return t.sum()

        torch.func.grad(f)(x.detach())
        assert seen == [None]


@pytest.mark.parametrize("op", OPS)
def test_double_backward_fails_as_the_general_path_does(triton_device, monkeypatch, op):
    mod, fn = OPS[op]
    dev = triton_device
    x, w = torch.randn(4, 8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)

    def second(lean):
        with monkeypatch.context() as m:
            if not lean:
                m.setattr(mod, "_lean", lambda *args: None)
            y = fn(x, (8,), w, None)
            try:
                gx, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
                gx.sum().backward()
            except Exception as exc:  # noqa: BLE001 (the same error either way)
                return type(exc), str(exc)[:80]
            return None, x.grad.clone()

    with apex.backend("triton"):
        a, b = second(True), second(False)
    assert a[0] is b[0]
    if a[0] is None:
        torch.testing.assert_close(a[1], b[1] / 2, rtol=0, atol=0)  # (x.grad accumulated twice)
    else:
        assert a[1] == b[1]


def test_a_tuning_override_is_taken(triton_device):
    """An override entered after a warm call empties the plans: the next launch takes it (and records it)."""
    from apex._kernels import _tuning

    dev = triton_device
    x, w = torch.randn(32, 64, device=dev, requires_grad=True), torch.randn(64, device=dev, requires_grad=True)
    dy = torch.randn(32, 64, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(L.layer_norm(x, (64,), w, None), (x, w), dy)
        y = L.layer_norm(x, (64,), w, None)
        cfg = {"rows": 4, "warps": 2, "programs_per_sm": 1, "split": 0}
        with _tuning.override("layer_norm.bwd", **cfg):
            got = torch.autograd.grad(y, (x, w), dy)
            assert _tuning.last["layer_norm.bwd"] == cfg
        fcfg = {"rows": 2, "warps": 1, "programs_per_sm": 0, "wtile": 0}
        with _tuning.override("layer_norm.fwd", **fcfg):
            y2 = L.layer_norm(x, (64,), w, None)
            assert _tuning.last["layer_norm.fwd"] == fcfg
    torch.testing.assert_close(got[0], ref[0])
    torch.testing.assert_close(got[1], ref[1])
    torch.testing.assert_close(y2, y, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ fused add + norm
from apex.ops import fused_add_norm as FA  # noqa: E402

ADD_OPS = {"fused_add_rms_norm": ("_lean_rms", lambda x, r, w, b, ns, me: FA.fused_add_rms_norm(x, r, w, ns, 1e-5, me)),
           "fused_add_layer_norm": ("_lean_ln", lambda x, r, w, b, ns, me: FA.fused_add_layer_norm(x, r, w, b, ns,
                                                                                                 1e-5, me))}


def _add_run(fn, x, r, w, b, ns, me, dy, dh):
    y, h = fn(x, r, w, b, ns, me)
    leaves = [t for t in (x, r, w, b) if t is not None and t.requires_grad]
    outs, grads = [y], [dy]
    if dh is not None:
        outs.append(h)
        grads.append(dh)
    return (y, h), list(torch.autograd.grad(outs, leaves, grads, allow_unused=True))


@pytest.mark.parametrize("op", ADD_OPS)
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.float16)], ids=str)
@pytest.mark.parametrize("kind", ["contiguous", "row-strided", "sliced"])
@pytest.mark.parametrize("me", [False, True])
@pytest.mark.parametrize("with_dh", [False, True])
def test_fused_add_lean_path_matches_the_general_path(triton_device, monkeypatch, op, dtypes, kind, me, with_dh):
    name, fn = ADD_OPS[op]
    dev = triton_device
    shape = (6, 10) if kind == "row-strided" else (2, 3, 10)
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit
            x = _layout(kind, shape, dtypes[0], dev).requires_grad_()
            r = _layout("contiguous", shape, dtypes[1], dev).requires_grad_()
            w = (torch.rand(10, device=dev) + 0.5).requires_grad_()
            b = torch.randn(10, device=dev, requires_grad=True) if op == "fused_add_layer_norm" else None
            dy = torch.randn(shape, device=dev).to(dtypes[0])
            dh = torch.randn(shape, device=dev).to(torch.promote_types(*dtypes)) if with_dh else None
            args = [_leaf(x), _leaf(r), _leaf(w), _leaf(b)]
            lean = _add_run(fn, *args, (10,), me, dy, dh)
            assert type(lean[0][0].grad_fn).__name__ == "_DirectAddNormBackward"
            with monkeypatch.context() as m:
                m.setattr(FA, name, lambda *a: None)
                general = _add_run(fn, _leaf(x), _leaf(r), _leaf(w), _leaf(b), (10,), me, dy, dh)
            for p, q in zip(lean[0], general[0]):
                assert p.dtype == q.dtype and p.stride() == q.stride()
                torch.testing.assert_close(p, q, rtol=0, atol=0)
            for p, q in zip(lean[1], general[1]):
                assert p.dtype == q.dtype and p.stride() == q.stride()
                torch.testing.assert_close(p, q, rtol=0, atol=0)
            with torch.no_grad():
                y0, h0 = fn(x, r, w, b, (10,), me)
                with monkeypatch.context() as m:
                    m.setattr(FA, name, lambda *a: None)
                    y1, h1 = fn(x, r, w, b, (10,), me)
            torch.testing.assert_close(y0, y1, rtol=0, atol=0)
            torch.testing.assert_close(h0, h1, rtol=0, atol=0)
    assert any(getattr(FA, name).__self__.table.plans.values())


@pytest.mark.parametrize("op", ADD_OPS)
def test_fused_add_errors_after_a_warm_call(triton_device, op):
    name, fn = ADD_OPS[op]
    dev = triton_device
    x, r = torch.randn(4, 8, device=dev, requires_grad=True), torch.randn(4, 8, device=dev)
    w = torch.randn(8, device=dev, requires_grad=True)
    with apex.backend("triton"):
        fn(x, r, w, None, (8,), False)
        y, _ = fn(x, r, w, None, (8,), False)
        assert type(y.grad_fn).__name__ == "_DirectAddNormBackward"
        with pytest.raises(ValueError, match="residual must have the input's shape"):
            fn(x, torch.randn(4, 6, device=dev), w, None, (8,), False)
        with pytest.raises(TypeError, match="residual must be a floating-point tensor"):
            fn(x, torch.ones(4, 8, dtype=torch.int64, device=dev), w, None, (8,), False)
        with pytest.raises(ValueError, match="residual is on meta"):
            fn(x, torch.randn(4, 8, device="meta"), w, None, (8,), False)
        with pytest.raises(ValueError, match="weight must have shape"):  # (the norm's checks first)
            fn(x, torch.randn(4, 6, device=dev), torch.randn(6, device=dev), None, (8,), False)
        r.data = r.data.half()  # another residual dtype: another plan, h in the promoted dtype
        y, h = fn(x, r, w, None, (8,), False)
        assert h.dtype == torch.float32 and type(y.grad_fn).__name__ == "_DirectAddNormBackward"


@pytest.mark.parametrize("op", ADD_OPS)
def test_fused_add_takes_the_last_plan_on_its_guard(triton_device, monkeypatch, op):
    """As test_a_call_with_the_last_calls_facts_takes_its_plan_on_the_guard, for fused add + norm."""
    from apex.ops import _norm_add_direct as D

    name, fn = ADD_OPS[op]
    dev = triton_device
    keyed = []
    exact = D._exact_shape
    monkeypatch.setattr(D, "_exact_shape", lambda s: keyed.append(s) or exact(s))
    ns = (8,)
    w = torch.randn(8, device=dev, requires_grad=True)
    b = torch.randn(8, device=dev, requires_grad=True) if op == "fused_add_layer_norm" else None
    dy = torch.randn(4, 8, device=dev)

    def check(x, r, w, b, guarded):
        del keyed[:]
        lean = _add_run(fn, _leaf(x), _leaf(r), _leaf(w), _leaf(b), ns, False, dy, None)
        with monkeypatch.context() as m:
            m.setattr(FA, name, lambda *a: None)
            general = _add_run(fn, _leaf(x), _leaf(r), _leaf(w), _leaf(b), ns, False, dy, None)
        for p, q in zip([*lean[0], *lean[1]], [*general[0], *general[1]]):
            assert p.dtype == q.dtype and p.stride() == q.stride()
            torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert (not keyed) == guarded, (keyed, guarded)

    def xr(rg=True):
        return (torch.randn(4, 8, device=dev, requires_grad=rg), torch.randn(4, 8, device=dev, requires_grad=rg))

    with apex.backend("triton"):
        fn(*xr(), w, b, ns, False)
        check(*xr(), w, b, True)
        check(xr()[0], torch.randn(8, 4, device=dev).t().requires_grad_(), w, b, False)  # the residual's strides
        check(xr()[0], xr()[1].half(), w, b, False)  # its dtype
        check(*xr(), None, b, False)
        check(*xr(False), w, b, False)
        check(*xr(), w, b, True)  # both guards kept
        check(*xr(False), w, b, True)
