"""The planned eager Triton path of index_mul_2d (apex.ops._index_mul_direct): the same bits as the general path
for every layout it plans, a new plan wherever a fact the checks or launches read changes, the index read at
every call, and the general path's errors after a warm call."""

from __future__ import annotations

import pytest
import torch

import apex
from apex._errors import AssertValueError
from apex.ops import index_mul_2d as IM
from tests import _device
from tests.ops._lean import same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the general path by design")


def _run(in1, in2, idx, gy):
    out = IM.index_mul_2d(in1, in2, idx)
    leaves = [t for t in (in1, in2) if t.requires_grad]
    return out, (list(torch.autograd.grad(out, leaves, gy)) if leaves else [])


def _both(monkeypatch, in1, in2, idx, gy):
    """``(lean, general)`` on copies of the inputs: the planned path, then the general one (lookup off)."""
    def leaf(t):
        return t.detach().clone().requires_grad_(t.requires_grad)

    lean = _run(leaf(in1), leaf(in2), idx, gy)
    with monkeypatch.context() as m:
        m.setattr(IM, "_lean", lambda *args: None)
        general = _run(leaf(in1), leaf(in2), idx, gy)
    return lean, general


def _same(a, b):
    same_run(a, b, strides=False)


def _t(kind, rows, f, dtype, dev):
    if kind == "contiguous":
        return torch.randn(rows, f, device=dev).to(dtype)
    if kind == "transposed":  # a feature stride of rows: the kernels read a contiguous copy
        return torch.randn(f, rows, device=dev).to(dtype).t()
    return torch.randn(rows * 2, f + 3, device=dev).to(dtype)[::2, :f]  # row stride 2·(f + 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k1", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("k2", ["contiguous", "transposed", "strided"])
@pytest.mark.parametrize("grads", ["both", "in1", "in2"])
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, dtype, k1, k2, grads):
    dev = triton_device
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit: fresh values each time
            in1 = _t(k1, 7, 12, dtype, dev).requires_grad_(grads != "in2")
            in2 = _t(k2, 20, 12, dtype, dev).requires_grad_(grads != "in1")
            idx = torch.randint(0, 7, (20,), device=dev)
            gy = torch.randn(20, 12, device=dev).to(dtype)
            lean, general = _both(monkeypatch, in1, in2, idx, gy)
            assert type(lean[0].grad_fn).__name__ == "_DirectMulBackward"
            _same(lean, general)


def test_a_changed_fact_takes_another_plan(triton_device, monkeypatch):
    """After a warm call, each change of a fact the checks or launches read gives the general path's values:
    rows of either input, features, dtype, strides, an int32 index, another index tensor (its values and its
    sort read at each call), the same index changed in place, grad mode."""
    dev = triton_device
    in1, in2 = torch.randn(6, 8, device=dev), torch.randn(10, 8, device=dev)
    idx = torch.randint(0, 6, (10,), device=dev)

    def variants():
        yield in1, in2, idx
        yield torch.randn(9, 8, device=dev), in2, idx  # in1's rows
        yield in1, torch.randn(4, 8, device=dev), idx[:4]  # in2's rows and the index's length
        yield torch.randn(6, 16, device=dev), torch.randn(10, 16, device=dev), idx  # features
        yield in1.half(), in2.half(), idx  # dtype
        yield torch.randn(8, 6, device=dev).t(), in2, idx  # in1's strides
        yield in1, torch.randn(20, 8, device=dev)[::2], idx  # in2's row stride
        yield in1, in2, idx.int()  # an int32 index
        yield in1, in2, torch.randint(0, 6, (10,), device=dev)  # another index, the same layout
        yield in1, in2, idx.flip(0)  # and another

    with apex.backend("triton"):
        for a, b, i in variants():
            gy = torch.randn(b.shape, device=dev).to(b.dtype)
            _same(*_both(monkeypatch, a.requires_grad_(), b.requires_grad_(), i, gy))
            with torch.no_grad():  # no graph: the plan's forward alone
                lean = IM.index_mul_2d(a, b, i)
            with monkeypatch.context() as m:
                m.setattr(IM, "_lean", lambda *args: None)
                torch.testing.assert_close(lean, IM.index_mul_2d(a, b, i), rtol=0, atol=0)
        j = idx.clone()
        a, b = in1.detach().requires_grad_(), in2.detach().requires_grad_()
        gy = torch.randn(10, 8, device=dev)
        before = _run(a, b, j, gy)
        j[:5] = torch.arange(5, device=dev)  # in place: the kept sort is stale, another is made
        after = _run(a, b, j, gy)
        _same(after, _both(monkeypatch, a, b, j, gy)[1])
        assert not torch.equal(after[1][0], before[1][0])


def test_unplanned_calls_take_the_general_path(triton_device):
    """fp64 (the PyTorch path) and empty inputs are never planned (kept as False): the general Function."""
    dev = triton_device
    plans = IM._lean.__self__.table.plans
    with apex.backend("triton"):
        for in1, in2, idx in ((torch.randn(3, 4, dtype=torch.float64, device=dev),
                               torch.randn(5, 4, dtype=torch.float64, device=dev), torch.tensor([0, 1, 2, 1, 0])),
                              (torch.randn(3, 0, device=dev), torch.randn(5, 0, device=dev),
                               torch.tensor([0, 1, 2, 1, 0]))):
            y = IM.index_mul_2d(in1.requires_grad_(), in2, idx.to(dev))
            assert type(y.grad_fn).__name__ == "IndexMul2dBackward"
            key = (in1.shape, True, in1.dtype, in1.device, in2.shape, True, in2.dtype, in2.device, idx.shape,
                   idx.dtype, idx.to(dev).device)  # (contiguous inputs: True for their strides)
            assert plans[key] is False
        y = IM.index_mul_2d(torch.randn(3, 4, device=dev), torch.randn(5, 4, device=dev), torch.tensor([0, 1, 2, 1, 0]))
        assert y.shape == (5, 4)  # (a planned call: launched)


def test_second_derivative_and_saved_inputs_with_other_strides(triton_device, monkeypatch):
    """create_graph takes the double-backward Function (a second derivative through it); a saved-tensor hook
    that gives the inputs back in another layout takes the general kernels' call: the same values."""
    dev = triton_device
    in1 = torch.randn(5, 6, device=dev, requires_grad=True)
    in2 = torch.randn(9, 6, device=dev, requires_grad=True)
    idx = torch.randint(0, 5, (9,), device=dev)
    gy = torch.randn(9, 6, device=dev)
    with apex.backend("triton"):
        ref = _both(monkeypatch, in1, in2, idx, gy)[1]
        y = IM.index_mul_2d(in1, in2, idx)
        g1, g2 = torch.autograd.grad(y, (in1, in2), gy, create_graph=True)
        assert g1.requires_grad and g2.requires_grad
        torch.testing.assert_close([g1, g2], ref[1], rtol=0, atol=0)
        (h,) = torch.autograd.grad((g1 * g1).sum() + g2.sum(), in2)
        with monkeypatch.context() as m:
            m.setattr(IM, "_lean", lambda *args: None)
            y = IM.index_mul_2d(in1, in2, idx)
            g1, g2 = torch.autograd.grad(y, (in1, in2), gy, create_graph=True)
            (h_ref,) = torch.autograd.grad((g1 * g1).sum() + g2.sum(), in2)
        torch.testing.assert_close(h, h_ref, rtol=0, atol=0)

        def pack(t):
            return t.detach().t().contiguous().t() if t.is_floating_point() else t  # column-major copies

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = IM.index_mul_2d(in1, in2, idx)
        torch.testing.assert_close(list(torch.autograd.grad(y, (in1, in2), gy)), ref[1], rtol=0, atol=0)


def test_a_bad_call_after_a_warm_one_still_raises(triton_device):
    dev = triton_device
    in1 = torch.randn(4, 3, device=dev, requires_grad=True)
    in2 = torch.randn(5, 3, device=dev, requires_grad=True)
    idx = torch.tensor([0, 1, 3, 3, 2], device=dev)
    with apex.backend("triton"):
        IM.index_mul_2d(in1, in2, idx)
        IM.index_mul_2d(in1, in2, idx)  # a hit
        with pytest.raises(AssertValueError, match="idx1 must be 1-D with in2's 5 rows"):
            IM.index_mul_2d(in1, in2, idx[:4])
        with pytest.raises(TypeError, match="idx1 must be an int64 or int32 tensor"):
            IM.index_mul_2d(in1, in2, idx.float())
        with pytest.raises(TypeError, match="in1 and in2 must have the same dtype"):
            IM.index_mul_2d(in1, in2.half(), idx)
        with pytest.raises(ValueError, match="in1 and in2 must have the same number of columns"):
            IM.index_mul_2d(in1, torch.randn(5, 4, device=dev), idx)
        with pytest.raises(ValueError, match="idx1 is on meta"):
            IM.index_mul_2d(in1, in2, idx.to("meta"))
        with pytest.raises(TypeError, match="in1 must be a floating-point"):
            IM.index_mul_2d([[1.0]], in2, idx)
        y = IM.index_mul_2d(in1, in2, idx)
    assert type(y.grad_fn).__name__ == "_DirectMulBackward"


def test_contiguous_inputs_with_any_stride_along_a_size_one_dim(triton_device, monkeypatch):
    """A contiguous input may hold any stride along a size-1 dim (where it addresses nothing): it shares the plan
    of its shape (keyed as contiguous) and gives the general path's values, which read its own strides."""
    dev = triton_device
    with apex.backend("triton"):
        for s1, s2 in (((6, 1), (6, 1)), ((999, 1), (6, 1)), ((6, 1), (1, 5))):
            in1 = torch.randn(6, device=dev).as_strided((1, 6), s1).detach().requires_grad_()
            in2 = torch.randn(4, 6, device=dev) if s2 == (6, 1) else torch.randn(4, device=dev).as_strided((4, 1), s2)
            in2 = in2.detach().requires_grad_()
            in1 = in1 if in2.shape[1] == 6 else torch.randn(3, 1, device=dev, requires_grad=True)
            assert in1.is_contiguous() and in2.is_contiguous()
            idx = torch.zeros(4, dtype=torch.int64, device=dev)
            gy = torch.randn(in2.shape, device=dev)
            lean, general = _both(monkeypatch, in1, in2, idx, gy)
            assert type(lean[0].grad_fn).__name__ == "_DirectMulBackward"
            _same(lean, general)
