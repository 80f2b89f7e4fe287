"""The planned eager Triton path of SoftmaxCrossEntropyLoss (apex.ops._xentropy_direct): the same bits as the
general path for every layout it plans, a new plan wherever a fact the checks or launches read changes, and the
general path's errors after a warm call."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.ops import _xentropy_direct as D
from apex.ops import xentropy as X
from tests import _device
from tests.ops._lean import record_launches, same_tensors

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
Loss = X.SoftmaxCrossEntropyLoss


def _is_lean(y):
    return type(y.grad_fn) is D._DirectLoss._backward_cls


def _run(x, lab, args, dy):
    """Losses and the logits' gradient (None where they need none)."""
    y = Loss.apply(x, lab, *args)
    return y, (torch.autograd.grad(y, x, dy)[0] if x.requires_grad else None)


def _both(monkeypatch, x, lab, args, dy):
    """``(lean, general)``: the call on the planned path, then on the general path (the plan lookup switched
    off), each on its own copy of the logits."""
    def leaf(t):
        return t.detach().clone().requires_grad_(t.requires_grad)

    lean = _run(leaf(x), lab, args, dy)
    with monkeypatch.context() as m:
        m.setattr(X, "_lean", lambda *a: None)
        general = _run(leaf(x), lab, args, dy)
    return lean, general


def _same(a, b):
    same_tensors(a, b)


def _logits(kind, m, v, dtype, dev):
    """``[m, v]`` logits: contiguous, or a slice of wider rows (unit column stride, another row stride)."""
    if kind == "contiguous":
        return (torch.randn(m, v, device=dev) * 3).to(dtype)
    return (torch.randn(m, v + 5, device=dev) * 3).to(dtype)[:, 2:2 + v]


def _labels(m, v, dev, kind="contiguous", padding_idx=0, dtype=torch.int64):
    lab = torch.randint(0, v, (m,), device=dev)
    if padding_idx is not None and m > 1:
        lab[1] = padding_idx
    if kind != "contiguous":
        lab = torch.stack([lab, lab], 1)[:, 0]  # every other element of a longer buffer
    return lab.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["contiguous", "sliced"])
@pytest.mark.parametrize("lab_kind", ["contiguous", "strided"])
@pytest.mark.parametrize("args", [(), (0.1,), (0.0, None), (0.2, 3, True), (0.1, 0, False, False)], ids=str)
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, dtype, kind, lab_kind, args):
    m, v = 6, 37
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit: fresh values each time
            x = _logits(kind, m, v, dtype, triton_device).requires_grad_()
            lab = _labels(m, v, triton_device, lab_kind, args[1] if len(args) > 1 else 0)
            dy = torch.rand(m, device=triton_device) + 0.5
            lean, general = _both(monkeypatch, x, lab, args, dy)
            assert _is_lean(lean[0])
            _same(lean, general)
            with torch.no_grad():  # no graph: the plan's forward alone
                y = Loss.apply(x, lab, *args)
            assert y.grad_fn is None
            _same((y,), (general[0],))


def test_gradients_in_other_layouts_and_out_of_range_labels(triton_device, monkeypatch):
    """An expanded gradient (a sum's) and a strided one are read at their strides; an out-of-range label gives
    the general path's NaN loss and zero gradient row."""
    dev = triton_device
    x = torch.randn(5, 9, device=dev, requires_grad=True)
    lab = torch.tensor([1, 9, 0, -1, 3], device=dev)
    with apex.backend("triton"):
        for dy in (torch.ones(1, device=dev).expand(5), torch.rand(10, device=dev)[::2], torch.rand(5, device=dev)):
            _same(*_both(monkeypatch, x, lab, (0.1, 0), dy))
            _same(*_both(monkeypatch, x, lab, (0.1, None), dy))


def test_a_changed_fact_takes_another_plan(triton_device, monkeypatch):
    """After a warm call, each change of a fact the checks or launches read (shape, dtype, strides, the labels'
    dtype and layout, smoothing, padding_idx) gives the general path's values."""
    dev = triton_device
    base = torch.randn(6, 20, device=dev)
    lab = _labels(6, 20, dev)

    def variants():
        yield base, lab, (0.1, 0)
        yield base, lab, (0.0, 0)  # smoothing (and the kernel's SMOOTH)
        yield base, lab, (0.1, 5)  # padding_idx
        yield base, lab, (0.1, None)
        yield torch.randn(3, 20, device=dev), lab[:3], (0.1, 0)  # rows
        yield torch.randn(6, 33, device=dev), _labels(6, 33, dev), (0.1, 0)  # vocabulary
        yield base.half(), lab, (0.1, 0)  # dtype
        yield base.bfloat16(), lab, (0.1, 0)
        yield torch.randn(6, 25, device=dev)[:, :20], lab, (0.1, 0)  # a row stride
        yield base, lab.int(), (0.1, 0)  # the labels' dtype
        yield base, _labels(6, 20, dev, "strided"), (0.1, 0)  # the labels' layout

    plans = X._lean.__self__.table.plans
    with apex.backend("triton"):
        for x, lb, args in variants():
            dy = torch.rand(x.shape[0], device=dev)
            lean, general = _both(monkeypatch, x.detach().requires_grad_(), lb, args, dy)
            assert _is_lean(lean[0])
            _same(lean, general)
    assert sum(1 for p in plans.values() if p) >= 11


def test_unplanned_calls_take_the_general_path(triton_device):
    """fp64 (the PyTorch path), logits that are not 2-D or whose columns are strided are kept as False;
    ``inplace_backward=True``, a smoothing that is not a float and a padding_idx that is no int take the general
    path (their checks each call)."""
    plans = X._lean.__self__.table.plans
    dev = triton_device
    lab = _labels(4, 8, dev)
    with apex.backend("triton"):
        for x, lb in ((torch.randn(4, 8, dtype=torch.float64, device=dev), lab),
                      (torch.randn(2, 2, 8, device=dev), lab.view(2, 2)),
                      (torch.randn(8, 4, device=dev).t(), lab)):
            x.requires_grad_()
            y = Loss.apply(x, lb, 0.1, 0)
            assert not _is_lean(y)
            key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, x.device, lb.shape, lb.is_contiguous(),
                   lb.dtype, lb.device, 0.1, 0)
            assert plans[key] is False
        x = torch.randn(4, 8, device=dev, requires_grad=True)
        assert _is_lean(Loss.apply(x, lab, 0.1, 0))
        for args in ((1, 0), (0.1, 0, False, True)):
            if args[-1] is True and len(args) == 4:
                y = Loss.apply(x * 1, lab, *args)
            else:
                y = Loss.apply(x, lab, *args)
            assert not _is_lean(y), args
        with pytest.raises(ValueError, match="smoothing must be a float"):
            Loss.apply(x, lab, True, 0)  # (True == 1.0: a key would take it for a planned smoothing)
        Loss.apply(x, lab, 1.0, 0)
        with pytest.raises(ValueError, match="smoothing must be a float"):
            Loss.apply(x, lab, True, 0)
        Loss.apply(x, lab, 0.1, 1)
        with pytest.raises(TypeError, match="padding_idx must be an int or None, got bool"):
            Loss.apply(x, lab, 0.1, True)  # (True == 1 as a key)


def test_a_bad_call_after_a_warm_one_still_raises(triton_device):
    dev = triton_device
    x = torch.randn(4, 10, device=dev, requires_grad=True)
    lab = _labels(4, 10, dev)
    with apex.backend("triton"):
        Loss.apply(x, lab, 0.1, 0)
        Loss.apply(x, lab, 0.1, 0)  # a hit
        with pytest.raises(ValueError, match=r"labels must have shape \[4\]"):
            Loss.apply(x, lab[:2], 0.1, 0)
        with pytest.raises(TypeError, match="labels must be an integer"):
            Loss.apply(x, lab.float(), 0.1, 0)
        with pytest.raises(TypeError, match="logits must be a floating-point"):
            Loss.apply(x.long(), lab, 0.1, 0)
        with pytest.raises(ValueError, match="smoothing"):
            Loss.apply(x, lab, 1.5, 0)
        with pytest.raises(ValueError, match="labels is on meta"):
            Loss.apply(x, lab.to("meta"), 0.1, 0)
        with pytest.raises(TypeError, match="padding_idx must be an int or None"):
            Loss.apply(x, lab, 0.1, 0.5)
        with pytest.raises(ValueError, match="leaf tensor"):
            Loss.apply(x, lab, 0.1, 0, False, True)
        with pytest.raises(TypeError, match="labels must be a torch.Tensor"):
            Loss.apply(x, [1, 2, 3, 0], 0.1, 0)
        y = Loss.apply(x, lab, 0.1, 0)  # the plan is still there, and right
    assert _is_lean(y)


def test_backward_of_saved_tensors_with_other_strides(triton_device):
    """A saved-tensor hook that gives the logits back in another layout: the general eager backward (which reads
    their strides), the same gradient."""
    dev = triton_device
    x = torch.randn(6, 10, device=dev, requires_grad=True)
    lab, dy = _labels(6, 10, dev), torch.rand(6, device=dev)
    with apex.backend("triton"):
        (ref,) = torch.autograd.grad(Loss.apply(x, lab, 0.1, 0), x, dy)

    def pack(t):
        if t.dim() == 2:  # the logits, in wider rows
            return torch.zeros(6, 14, dtype=t.dtype, device=t.device)[:, 1:11].copy_(t)
        if t.dtype == torch.int64:  # the labels, strided
            return torch.stack([t, t], 1)[:, 0]
        return t

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = Loss.apply(x, lab, 0.1, 0)
    assert _is_lean(y)
    with apex.backend("triton"):
        (got,) = torch.autograd.grad(y, x, dy)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_compile_func_and_modes_take_the_general_path(triton_device, monkeypatch):
    from tests.ops._modes import Recorder

    dev = triton_device
    x = torch.randn(4, 10, device=dev, requires_grad=True)
    lab = _labels(4, 10, dev)
    with apex.backend("triton"):
        ref = Loss.apply(x, lab, 0.1, 0)
        with Recorder() as rec:
            y = Loss.apply(x, lab, 0.1, 0)
        assert "apex::softmax_xentropy_fwd" in rec.ops and not _is_lean(y)
        g = torch.func.grad(lambda t: Loss.apply(t, lab, 0.1, 0).sum())(x.detach())
        (want,) = torch.autograd.grad(ref.sum(), x)
        torch.testing.assert_close(g, want, rtol=0, atol=0)
        seen = []
        lean = X._lean
        monkeypatch.setattr(X, "_lean", lambda *a: seen.append(1) or lean(*a))
        got = torch.compile(lambda t: Loss.apply(t, lab, 0.1, 0), backend="eager")(x)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        assert seen == []  # (Dynamo takes the Function itself: apply is not called)


def test_the_plan_respects_a_tuning_override(triton_device):
    """An override entered after a layout was planned (between a forward and its backward too) is the one the
    launches take, as the general launcher's."""
    from apex._kernels import _tuning

    dev = triton_device
    x = torch.randn(8, 40, device=dev, requires_grad=True)
    lab, dy = _labels(8, 40, dev), torch.rand(8, device=dev)
    with apex.backend("triton"):
        ref_y = Loss.apply(x, lab, 0.1, 0)
        (ref,) = torch.autograd.grad(ref_y, x, dy)
        y = Loss.apply(x, lab, 0.1, 0)
        with _tuning.override("xentropy.bwd", rows=1, block=16, warps=1):
            (got,) = torch.autograd.grad(y, x, dy)
            assert _tuning.last["xentropy.bwd"]["block"] == 16
        with _tuning.override("xentropy.fwd", rows=2, block=16, warps=1, stages=1):
            y2 = Loss.apply(x, lab, 0.1, 0)
            assert _tuning.last["xentropy.fwd"]["block"] == 16
        Loss.apply(x, lab, 0.1, 0)
        assert _tuning.last["xentropy.fwd"]["block"] != 16
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(y2, ref_y)  # (other chunks: another summation order)


def test_the_lean_path_is_taken(triton_device, monkeypatch):
    """A warm call launches from its plan: neither the checks nor the general launchers run."""
    from apex._kernels import xentropy as K

    dev = triton_device
    x = torch.randn(4, 10, device=dev, requires_grad=True)
    lab = _labels(4, 10, dev)
    with apex.backend("triton"):
        Loss.apply(x, lab, 0.1, 0, True)  # the miss: planned
        for name, owner in (("_check", X), ("forward", K), ("backward", K), ("_forward", X), ("_backward", X)):
            monkeypatch.setattr(owner, name, lambda *a, name=name, **k: pytest.fail(f"{name} ran"))
        monkeypatch.setattr(X._lean.__self__, "check", lambda *a: pytest.fail("check ran"))
        y = Loss.apply(x, lab, 0.1, 0, True)
        torch.autograd.grad(y, x, torch.ones_like(y))
        with torch.no_grad():
            Loss.apply(x, lab, 0.1, 0)
    assert _is_lean(y) and type(y.grad_fn).__name__ == "SoftmaxCrossEntropyLossBackward"


@pytest.mark.parametrize("args", [(0.1, 0), (0.0, None), (0.3, 7)], ids=str)
def test_the_launches_are_the_general_paths(triton_device, monkeypatch, args):
    """The same launches (grid, arguments, warps) as the general launchers, forward and backward, with
    gradients of several layouts and a backward configuration of its own."""
    from apex._kernels import _tuning
    from apex._kernels import xentropy as K

    dev = triton_device
    x = torch.randn(9, 30, device=dev)[:, 1:21].requires_grad_()
    lab = _labels(9, 20, dev)
    grads = (torch.rand(9, device=dev), torch.ones(1, device=dev).expand(9), torch.rand(18, device=dev)[::2])
    with apex.backend("triton"), _tuning.override("xentropy.bwd", rows=2, block=16, warps=2):
        Loss.apply(x, lab, *args)  # planned
        got = record_launches(monkeypatch, [K._xent_fwd, K._xent_bwd])
        for g in grads:
            torch.autograd.grad(Loss.apply(x, lab, *args), x, g)
        with monkeypatch.context() as m:
            m.setattr(X, "_lean", lambda *a: None)
            want = record_launches(m, [K._xent_fwd, K._xent_bwd])
            for g in grads:
                torch.autograd.grad(Loss.apply(x, lab, *args), x, g)
    assert len(got) == 6 and got == want
