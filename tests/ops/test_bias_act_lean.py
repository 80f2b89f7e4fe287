"""The planned eager Triton path of bias_gelu and bias_swiglu (apex.ops._bias_act_direct): the same bits as
the general path for every layout it plans, a new plan wherever a fact the checks or launches read changes,
and the general path's errors after a warm call."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.ops import bias_gelu as G
from apex.ops import bias_swiglu as S
from tests import _device
from tests.ops._lean import same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")

OPS = {"bias_gelu": (G, G.bias_gelu), "bias_swiglu": (S, S.bias_swiglu)}


def _run(fn, x, b, dy):
    """Output and the gradients of every leaf that requires one (None for the others)."""
    y = fn(x, b)
    leaves = [t for t in (x, b) if t is not None and t.requires_grad]
    grads = list(torch.autograd.grad(y, leaves, dy)) if leaves and y.requires_grad else []
    return y, grads


def _both(monkeypatch, mod, fn, x, b, dy):
    """``(lean, general)``: the call on the planned path, then on the general path (the plan lookup switched
    off), each on its own copies of the inputs."""
    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)

    lean = _run(fn, leaf(x), leaf(b), dy)
    with monkeypatch.context() as m:
        m.setattr(mod, "_lean", lambda input, bias: None)
        general = _run(fn, leaf(x), leaf(b), dy)
    return lean, general


def _same(a, b):
    same_run(a, b)
    assert a[0].is_contiguous()


def _layout(kind, shape, dtype, dev):
    """An input of ``shape`` in the layout ``kind``: contiguous, a transposed 2-D view, every other row of a
    taller 2-D tensor, or the leading columns of a wider one (any rank: its rows are still a view)."""
    if kind == "contiguous":
        return torch.randn(shape, device=dev).to(dtype)
    if kind == "transposed":
        return torch.randn(shape[::-1], device=dev).to(dtype).t()
    if kind == "row-strided":
        return torch.randn(shape[0] * 2, *shape[1:], device=dev).to(dtype)[::2]
    return torch.randn(*shape[:-1], shape[-1] * 2, device=dev).to(dtype)[..., :shape[-1]]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind,shape", [("contiguous", (6, 10)), ("contiguous", (2, 3, 10)),
                                        ("transposed", (6, 10)), ("row-strided", (6, 10)),
                                        ("sliced", (3, 4, 10))], ids=str)
@pytest.mark.parametrize("bias", ["grad", "no-grad", "none"])
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, op, dtype, kind, shape, bias):
    mod, fn = OPS[op]
    n = shape[-1]
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit: fresh values each time
            x = _layout(kind, shape, dtype, triton_device).requires_grad_()
            b = torch.randn(n, device=triton_device).to(dtype).requires_grad_(bias == "grad")
            b = None if bias == "none" else b
            out = (*shape[:-1], n // 2 if op == "bias_swiglu" else n)
            dy = torch.randn(out, device=triton_device).to(dtype)
            lean, general = _both(monkeypatch, mod, fn, x, b, dy)
            assert type(lean[0].grad_fn).__name__ == "_DirectActBackward"
            _same(lean, general)


@pytest.mark.parametrize("op", OPS)
def test_a_changed_fact_takes_another_plan(triton_device, monkeypatch, op):
    """After a warm call, each change of a fact the checks or launches read (shape, dtype, strides, the bias
    present or absent, its dtype, which inputs need a gradient, grad mode) gives the general path's values."""
    mod, fn = OPS[op]
    dev = triton_device
    base = torch.randn(8, 12, device=dev)

    def variants():
        yield base, torch.randn(12, device=dev)
        yield torch.randn(5, 12, device=dev), torch.randn(12, device=dev)  # rows
        yield torch.randn(8, 20, device=dev), torch.randn(20, device=dev)  # width
        yield base.half(), torch.randn(12, device=dev).half()  # dtype
        yield base.bfloat16(), torch.randn(12, device=dev)  # an fp32 bias with a bf16 input
        yield torch.randn(12, 8, device=dev).t(), torch.randn(12, device=dev)  # strides
        yield torch.randn(16, 12, device=dev)[::2], torch.randn(12, device=dev)  # a row stride
        yield base.view(2, 4, 12), torch.randn(12, device=dev)  # leading dims
        yield base, None  # no bias
        yield base, torch.randn(24, device=dev)[::2]  # a strided bias (copied for the kernels)

    plans = mod._lean.__self__.table.plans
    with apex.backend("triton"):
        for x, b in variants():
            for xg, bg in ((True, True), (True, False), (False, True)):
                if b is None and not xg:
                    continue
                xx = x.detach().requires_grad_(xg)
                bb = None if b is None else b.detach().requires_grad_(bg)
                n = x.shape[-1]
                dy = torch.randn(*x.shape[:-1], n // 2 if op == "bias_swiglu" else n, device=dev).to(x.dtype)
                _same(*_both(monkeypatch, mod, fn, xx, bb, dy))
            with torch.no_grad():  # no graph: the plan's forward alone
                lean = fn(x, b)
            with monkeypatch.context() as m:
                m.setattr(mod, "_lean", lambda input, bias: None)
                torch.testing.assert_close(lean, fn(x, b), rtol=0, atol=0)
    assert sum(1 for p in plans.values() if p) >= 9  # (the strided bias shares the first one's plan)


@pytest.mark.parametrize("op", OPS)
def test_unplanned_layouts_take_the_general_path(triton_device, op):
    """fp64 (the PyTorch path), an empty input and rows that are no view of the input are never planned: kept as
    False, and the call's result is the general path's."""
    mod, fn = OPS[op]
    plans = mod._lean.__self__.table.plans
    dev = triton_device
    with apex.backend("triton"):
        for x in (torch.randn(4, 6, dtype=torch.float64, device=dev), torch.randn(0, 6, device=dev),
                  torch.randn(6, 3, 4, device=dev).permute(1, 0, 2)):  # [3, 6, 4]: rows need a copy
            x.requires_grad_()
            y = fn(x, None)
            assert type(y.grad_fn).__name__ != "_DirectActBackward"
            key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, x.device)  # (a contiguous one's: True)
            assert plans[key] is False


@pytest.mark.parametrize("op", OPS)
def test_a_bad_call_after_a_warm_one_still_raises(triton_device, op):
    mod, fn = OPS[op]
    dev = triton_device
    x, b = torch.randn(4, 8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    with apex.backend("triton"):
        fn(x, b)
        fn(x, b)  # a hit
        with pytest.raises(ValueError, match="bias must be a float tensor of shape"):
            fn(x, torch.randn(6, device=dev))
        with pytest.raises(ValueError, match="bias must be a float tensor of shape"):
            fn(x, torch.ones(8, dtype=torch.int64, device=dev))
        with pytest.raises(ValueError, match="bias is on meta"):
            fn(x, torch.randn(8, device="meta"))
        with pytest.raises(ValueError, match="input must be a float"):
            fn(torch.ones(4, 8, dtype=torch.int64, device=dev), None)
        with pytest.raises(TypeError, match="bias must be a torch.Tensor or None"):
            fn(x, [1.0] * 8)
        with pytest.raises(TypeError, match="input must be a torch.Tensor"):
            fn("x", None)
        if op == "bias_swiglu":
            with pytest.raises(ValueError, match="last dim must be even"):
                fn(torch.randn(4, 7, device=dev), None)
        fn(x, b)  # the plan is still there, and right
        with torch.enable_grad():
            y = fn(x, b)
        assert type(y.grad_fn).__name__ == "_DirectActBackward"


@pytest.mark.parametrize("op", OPS)
def test_backward_of_a_saved_input_with_other_strides(triton_device, monkeypatch, op):
    """A saved-tensor hook that gives the input back in another layout: the backward reads its strides (the
    general launchers), the same gradients."""
    mod, fn = OPS[op]
    dev = triton_device
    x, b = torch.randn(6, 10, device=dev, requires_grad=True), torch.randn(10, device=dev, requires_grad=True)
    dy = torch.randn(6, 5 if op == "bias_swiglu" else 10, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(fn(x, b), (x, b), dy)

    def pack(t):
        return t.detach().t().contiguous().t() if t.dim() == 2 else t  # column-major copy

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x, b)
    with apex.backend("triton"):
        got = torch.autograd.grad(y, (x, b), dy)
    for p, q in zip(got, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_swiglu_backward_takes_an_override_made_after_its_forward(triton_device):
    """The backward's kernel configuration is looked up at the backward, as the general launcher's: an
    override entered between a forward and its backward is the one it launches with."""
    from apex._kernels import _tuning
    from apex._kernels import bias_swiglu as K

    dev = triton_device
    x, b = torch.randn(32, 64, device=dev, requires_grad=True), torch.randn(64, device=dev, requires_grad=True)
    dy = torch.randn(32, 32, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(S.bias_swiglu(x, b), (x, b), dy)
        y = S.bias_swiglu(x, b)
        cfg = {"rows": 8, "cols": 16, "warps": 2, "stages": 1, "splits": 2}
        with _tuning.override(K.BWD_DB, **cfg):
            got = torch.autograd.grad(y, (x, b), dy)
            assert _tuning.last[K.BWD_DB] == cfg
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], ref[1])  # (two row chunks: another summation order)


@pytest.mark.parametrize("op", OPS)
def test_contiguous_inputs_with_any_stride_along_a_size_one_dim(triton_device, monkeypatch, op):
    """A contiguous input may hold any stride along a size-1 dim (where it addresses nothing): it shares the
    plan of its shape (keyed as contiguous) and gives the general path's values, which read its own strides."""
    mod, fn = OPS[op]
    dev = triton_device
    with apex.backend("triton"):
        for strides in ((10, 1), (999, 1), (3, 1)):
            x = torch.randn(10, device=dev).as_strided((1, 10), strides).detach().requires_grad_()
            assert x.is_contiguous()
            b = torch.randn(10, device=dev, requires_grad=True)
            dy = torch.randn(1, 5 if op == "bias_swiglu" else 10, device=dev)
            lean, general = _both(monkeypatch, mod, fn, x, b, dy)
            assert type(lean[0].grad_fn).__name__ == "_DirectActBackward"
            _same(lean, general)
