"""The planned eager Triton path of scaled_masked_softmax (apex.ops._softmax_direct): the same bits as the
general path for every layout it plans, a new plan wherever a fact the checks or launches read changes (the
mask's shape and layout among them), the scale read at every call, and the general path's errors after a warm
call."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.ops import scaled_masked_softmax as S
from apex.transformer.functional import fused_softmax as FS
from tests import _device
from tests.ops._lean import same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")


def _run(fn, x, dy):
    y = fn(x)
    return y, (list(torch.autograd.grad(y, x, dy)) if y.requires_grad else [])


def _both(monkeypatch, fn, x, dy):
    """``(lean, general)`` on copies of ``x``: the planned path, then the general one (the lookup off)."""
    lean = _run(fn, x.detach().clone().requires_grad_(x.requires_grad), dy)
    with monkeypatch.context() as m:
        m.setattr(S, "_lean", lambda *args: None)
        general = _run(fn, x.detach().clone().requires_grad_(x.requires_grad), dy)
    return lean, general


def _same(a, b):
    same_run(a, b, strides=False)
    assert all(t.is_contiguous() for t in (a[0], *a[1]))


def _scores(kind, shape, dtype, dev):
    if kind == "contiguous":
        return torch.randn(shape, device=dev).to(dtype)
    if kind == "transposed":  # heads and queries swapped in memory
        return torch.randn(shape[0], shape[2], shape[1], shape[3], device=dev).to(dtype).transpose(1, 2)
    return torch.randn(*shape[:-1], shape[-1] + 5, device=dev).to(dtype)[..., :shape[-1]]  # a row stride


MASKS = [None, (2, 1, 5, 7), (1, 1, 5, 7), (2, 1, 1, 7), (5, 7), (2, 3, 5, 7), "uint8", "strided"]


def _mask(m, dev):
    if m is None:
        return None
    if m == "uint8":
        return (torch.rand(2, 1, 5, 7, device=dev) < 0.3).to(torch.uint8)
    if m == "strided":  # a column view of a wider mask
        return (torch.rand(2, 1, 5, 14, device=dev) < 0.3)[..., ::2]
    return torch.rand(m, device=dev) < 0.3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["contiguous", "transposed", "sliced"])
@pytest.mark.parametrize("mask", MASKS, ids=str)
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, dtype, kind, mask):
    dev = triton_device
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit: fresh values each time
            x = (3 * _scores(kind, (2, 3, 5, 7), dtype, dev)).requires_grad_()
            m = _mask(mask, dev)
            dy = torch.randn(2, 3, 5, 7, device=dev).to(dtype)
            lean, general = _both(monkeypatch, lambda t, m=m: S.scaled_masked_softmax(t, m, 0.37), x, dy)
            assert type(lean[0].grad_fn).__name__ == "_DirectSoftmaxBackward"
            _same(lean, general)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("three_d", [False, True])
def test_causal_lean_path_matches_the_general_path(triton_device, monkeypatch, dtype, three_d):
    """The causal entries: the op's (4-D and 3-D scores), Megatron's function, and a non-contiguous gradient."""
    dev = triton_device
    shape = (6, 9, 9) if three_d else (2, 3, 9, 9)
    with apex.backend("triton"):
        for _ in range(2):
            x = torch.randn(shape, device=dev).to(dtype).requires_grad_()
            dy = torch.randn(shape, device=dev).to(dtype)
            lean, general = _both(monkeypatch, lambda t: S.scaled_masked_softmax(t, None, 0.5, causal=True), x, dy)
            assert type(lean[0].grad_fn).__name__ == "_DirectSoftmaxBackward"
            _same(lean, general)
            dyt = torch.randn(shape[::-1], device=dev).to(dtype).permute(*range(len(shape) - 1, -1, -1))
            _same(*_both(monkeypatch, lambda t: S.scaled_masked_softmax(t, None, 0.5, causal=True), x, dyt))
            if not three_d:
                fn = lambda t: FS.scaled_upper_triang_masked_softmax(t, None, 0.5)  # noqa: E731
                _same(*_both(monkeypatch, fn, x, dy))


def test_a_changed_fact_takes_another_plan(triton_device, monkeypatch):
    """After a warm call, each change of a fact the checks or launches read gives the general path's values:
    the scores' shape, dtype and strides, causal, the mask present or absent, its shape, strides and dtype;
    and the scale (not planned: read at every call), grad mode, requires_grad."""
    dev = triton_device
    x = torch.randn(2, 3, 5, 5, device=dev)
    m = torch.rand(2, 1, 5, 5, device=dev) < 0.3

    def variants():
        yield x, m, 0.5, False
        yield x, m, 0.25, False  # the scale alone
        yield x, m, torch.tensor(0.75), False  # a tensor scale
        yield x, None, 0.5, False
        yield x, None, 0.5, True  # causal
        yield x, m, 0.5, True
        yield x, m[:1], 0.5, False  # the mask's batch broadcast
        yield x, m[..., :1, :], 0.5, False  # a key-padding mask
        yield x, m.to(torch.uint8), 0.5, False
        yield x, m.transpose(2, 3), 0.5, False  # the mask's strides
        yield torch.randn(2, 3, 4, 5, device=dev), m[:, :, :4], 0.5, False  # sq
        yield x.half(), m, 0.5, False
        yield x.transpose(2, 3), m, 0.5, False  # the scores' strides
        yield x.view(6, 5, 5), m[0], 0.5, False  # 3-D scores, a 2-D mask

    with apex.backend("triton"):
        for s, mm, scale, causal in variants():
            fn = lambda t, mm=mm, scale=scale, causal=causal: S.scaled_masked_softmax(t, mm, scale, causal)  # noqa: E731
            dy = torch.randn(s.shape, device=dev).to(s.dtype)
            _same(*_both(monkeypatch, fn, s.detach().requires_grad_(), dy))
            _same(*_both(monkeypatch, fn, s, dy))  # no gradient needed: the plan's forward alone
            with torch.no_grad():
                _same(*_both(monkeypatch, fn, s.detach().requires_grad_(), dy))


def test_unplanned_calls_take_the_general_path(triton_device):
    """fp64 (the PyTorch path), empty scores and a mask that only broadcasts to the 3-D scores (the launcher's
    error) are never planned: kept as False, the general path's result or error."""
    dev = triton_device
    plans = S._lean.__self__.table.plans
    with apex.backend("triton"):
        for x in (torch.randn(1, 2, 3, 4, dtype=torch.float64, device=dev), torch.randn(1, 0, 3, 4, device=dev)):
            y = S.scaled_masked_softmax(x.requires_grad_(), None, 0.5)
            assert type(y.grad_fn).__name__ != "_DirectSoftmaxBackward"
            assert plans[(x.shape, True, x.dtype, x.device, False)] is False  # (contiguous: True for its strides)
        x, m = torch.randn(6, 5, 5, device=dev, requires_grad=True), torch.rand(6, 5, 5, device=dev) < 0.3
        for _ in range(2):
            with pytest.raises(RuntimeError, match="does not broadcast"):
                S.scaled_masked_softmax(x, m, 1.0)
        assert plans[(x.shape, True, x.dtype, x.device, False, m.shape, True, m.dtype, m.device)] is False
        S.scaled_masked_softmax(x, m[0], 1.0)  # (a mask that broadcasts to the 4-D view too: planned, launched)


def test_a_bad_call_after_a_warm_one_still_raises(triton_device):
    dev = triton_device
    x = torch.randn(2, 3, 4, 5, device=dev, requires_grad=True)
    m = torch.zeros(2, 1, 4, 5, dtype=torch.bool, device=dev)
    with apex.backend("triton"):
        S.scaled_masked_softmax(x, m, 1.0)
        S.scaled_masked_softmax(x, m, 1.0)  # a hit
        with pytest.raises(TypeError, match=r"scale must be a real number"):
            S.scaled_masked_softmax(x, m, "2")  # the same layout: a hit, the scale still checked
        with pytest.raises(ValueError, match=r"mask of shape \[2, 1, 3, 5\] does not broadcast"):
            S.scaled_masked_softmax(x, torch.zeros(2, 1, 3, 5, dtype=torch.bool, device=dev), 1.0)
        with pytest.raises(TypeError, match=r"mask must be a bool"):
            S.scaled_masked_softmax(x, m.float(), 1.0)
        with pytest.raises(ValueError, match=r"mask is on meta"):
            S.scaled_masked_softmax(x, m.to("meta"), 1.0)
        with pytest.raises(ValueError, match=r"sq == sk"):
            S.scaled_masked_softmax(x, None, 1.0, causal=True)
        with pytest.raises(TypeError, match=r"mask must be a torch.Tensor or None"):
            S.scaled_masked_softmax(x, [[True]], 1.0)
        with pytest.raises(TypeError, match=r"input must be a torch.Tensor"):
            S.scaled_masked_softmax("x", None, 1.0)
        y = S.scaled_masked_softmax(x, m, 1.0)
    assert type(y.grad_fn).__name__ == "_DirectSoftmaxBackward"


def test_second_derivative_and_saved_output_in_another_layout(triton_device, monkeypatch):
    """create_graph takes the registered backward op (its error at a second backward, as before); a saved-tensor
    hook that gives the output back in another layout takes the general launcher: the same gradient."""
    dev = triton_device
    x = torch.randn(2, 2, 4, 4, device=dev, requires_grad=True)
    dy = torch.randn(2, 2, 4, 4, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(S.scaled_masked_softmax(x, None, 0.5), x, dy)
        g, = torch.autograd.grad(S.scaled_masked_softmax(x, None, 0.5), x, dy, create_graph=True)
        torch.testing.assert_close(g, ref[0], rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="no autograd formula"):
            g.sum().backward()

        def pack(t):
            return t.detach().transpose(2, 3).contiguous().transpose(2, 3)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = S.scaled_masked_softmax(x, None, 0.5)
        torch.testing.assert_close(torch.autograd.grad(y, x, dy), ref, rtol=0, atol=0)


def test_backward_takes_an_override_made_after_its_forward(triton_device):
    """The backward's launch configuration is looked up at the backward, as the general launcher's."""
    from apex._kernels import _tuning
    from apex._kernels import scaled_masked_softmax as K

    dev = triton_device
    x = torch.randn(1, 3, 8, 8, device=dev, requires_grad=True)
    dy = torch.randn(1, 3, 8, 8, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(S.scaled_masked_softmax(x, None, 0.5), x, dy)
        y = S.scaled_masked_softmax(x, None, 0.5)
        with _tuning.override(K.BWD_OP, rows=2, warps=1):
            got = torch.autograd.grad(y, x, dy)
            assert _tuning.last[K.BWD_OP]["rows"] == 2
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_contiguous_tensors_with_any_stride_along_a_size_one_dim(triton_device, monkeypatch):
    """Contiguous scores and masks may hold any stride along a size-1 dim (where it addresses nothing): they share
    the plan of their shapes (keyed as contiguous) and give the general path's values, which read their own."""
    dev = triton_device
    with apex.backend("triton"):
        for xs, ms in (((35, 35, 7, 1), (35, 35, 7, 1)), ((35, 999, 7, 1), (35, 3, 7, 1)), ((35, 1, 7, 1),
                                                                                           (35, 0, 7, 1))):
            x = torch.randn(70, device=dev).as_strided((2, 1, 5, 7), xs).detach().requires_grad_()
            m = (torch.rand(70, device=dev) < 0.3).as_strided((2, 1, 5, 7), ms)
            assert x.is_contiguous() and m.is_contiguous()
            dy = torch.randn(2, 1, 5, 7, device=dev)
            lean, general = _both(monkeypatch, lambda t, m=m: S.scaled_masked_softmax(t, m, 0.5), x, dy)
            assert type(lean[0].grad_fn).__name__ == "_DirectSoftmaxBackward"
            _same(lean, general)
