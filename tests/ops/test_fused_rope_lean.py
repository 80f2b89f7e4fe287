"""The planned eager Triton path of fused_rope (apex.ops._rope_direct): the same bits as the general path for
every layout it plans, a new plan wherever a fact the checks or launches read changes, and the general path's
errors after a warm call."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.ops import fused_rope as R
from tests import _device
from tests.ops._lean import record_launches, same_tensors

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")

LEAN = "_DirectRopeBackward"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _run(t, freqs, tr, dy):
    """Output and the input's gradient (None where it needs none)."""
    y = R.fused_rope(t, freqs, tr)
    return y, (torch.autograd.grad(y, t, dy)[0] if t.requires_grad else None)


def _both(monkeypatch, t, freqs, tr, dy):
    """``(lean, general)``: the call on the planned path, then on the general path (the plan lookup switched
    off), each on its own copy of the input."""
    def leaf(x):
        return x.detach().clone().requires_grad_(x.requires_grad)

    lean = _run(leaf(t), freqs, tr, dy)
    with monkeypatch.context() as m:
        m.setattr(R, "_lean", lambda t, freqs, tr: None)
        general = _run(leaf(t), freqs, tr, dy)
    return lean, general


def _same(a, b):
    a, b = list(a), list(b)
    same_tensors(a, b)
    assert [p._is_view() for p in a if p is not None] == [q._is_view() for q in b if q is not None]


def _layout(kind, shape, dtype, dev):
    """An input of ``shape`` in the layout ``kind``: contiguous, ``[b, s, h, d]`` memory seen as ``sbhd``,
    the head and head-dim dims swapped in memory, or a strided slice of wider rows."""
    s, b, h, d = shape
    if kind == "contiguous":
        return torch.randn(shape, device=dev).to(dtype)
    if kind == "sb_swapped":
        return torch.randn(b, s, h, d, device=dev).to(dtype).transpose(0, 1)
    if kind == "hd_swapped":
        return torch.randn(s, b, d, h, device=dev).to(dtype).transpose(2, 3)
    return torch.randn(s, b, h, d + 6, device=dev).to(dtype)[..., 3:3 + d]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["contiguous", "sb_swapped", "hd_swapped", "sliced"])
@pytest.mark.parametrize("rot", [16, 10, 0])
@pytest.mark.parametrize("tr", [False, True])
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, dtype, kind, rot, tr):
    shape = (5, 2, 3, 16)
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit: fresh values each time
            t = _layout(kind, shape, dtype, triton_device).requires_grad_()
            freqs = torch.rand(5, 1, 1, rot, device=triton_device) * 6
            dy = torch.randn(shape, device=triton_device).to(dtype)
            lean, general = _both(monkeypatch, t, freqs, tr, dy)
            assert type(lean[0].grad_fn).__name__ == LEAN
            _same(lean, general)
            with torch.no_grad():  # no graph: the plan's forward alone
                y = R.fused_rope(t, freqs, tr)
            _same((y,), (general[0],))


def test_gradients_in_other_layouts(triton_device, monkeypatch):
    """A gradient that is not contiguous (a transposed copy, an expanded one) is read at its own strides."""
    dev = triton_device
    t = torch.randn(4, 2, 3, 8, device=dev, requires_grad=True)
    freqs = torch.rand(4, 1, 1, 8, device=dev) * 6
    with apex.backend("triton"):
        for dy in (torch.randn(2, 4, 3, 8, device=dev).transpose(0, 1), torch.randn(1, 1, 1, 8, device=dev)
                   .expand(4, 2, 3, 8), torch.randn(4, 2, 3, 8, device=dev)):
            for tr in (False, True):
                _same(*_both(monkeypatch, t, freqs, tr, dy))


def test_a_changed_fact_takes_another_plan(triton_device, monkeypatch):
    """After a warm call, each change of a fact the checks or launches read (shape, dtype, strides, the table's
    shape, strides and width, transpose_output_memory) gives the general path's values."""
    dev = triton_device
    base = torch.randn(6, 2, 4, 16, device=dev)
    f = torch.rand(6, 1, 1, 16, device=dev) * 6

    def variants():
        yield base, f, False
        yield base, f, True  # the output's layout
        yield torch.randn(3, 2, 4, 16, device=dev), f[:3], False  # sequence length
        yield torch.randn(6, 1, 4, 16, device=dev), f, False  # batch
        yield torch.randn(6, 2, 4, 32, device=dev), f, False  # head dim (the table narrower)
        yield base.half(), f, False  # dtype
        yield base.bfloat16(), f, True
        yield base.transpose(2, 3).contiguous().transpose(2, 3), f, False  # strides
        yield base, f[..., :8], False  # the table's width
        yield base, torch.rand(6, 1, 1, 32, device=dev)[..., ::2], False  # the table's strides
        yield base, torch.rand(6, 1, 1, 16, device=dev).expand(6, 1, 1, 16), False

    plans = R._lean.__self__.table.plans
    with apex.backend("triton"):
        for t, freqs, tr in variants():
            dy = torch.randn(t.shape, device=dev).to(t.dtype)
            lean, general = _both(monkeypatch, t.detach().requires_grad_(), freqs, tr, dy)
            assert type(lean[0].grad_fn).__name__ == LEAN
            _same(lean, general)
    assert sum(1 for p in plans.values() if p) >= 10


def test_unplanned_calls_take_the_general_path(triton_device):
    """fp64 (the PyTorch path), an empty input and fp64 angles are kept as False; a table that requires a
    gradient and a flag that is not a bool take the general path (its graph, its conversion)."""
    plans = R._lean.__self__.table.plans
    dev = triton_device
    with apex.backend("triton"):
        for t, freqs in ((torch.randn(4, 1, 2, 8, dtype=torch.float64, device=dev), torch.rand(4, 1, 1, 8, device=dev)),
                         (torch.randn(0, 1, 2, 8, device=dev), torch.rand(0, 1, 1, 8, device=dev)),
                         (torch.randn(4, 1, 2, 8, dtype=torch.float64, device=dev),
                          torch.rand(4, 1, 1, 8, dtype=torch.float64, device=dev))):
            t.requires_grad_()
            y = R.fused_rope(t, freqs)
            assert type(y.grad_fn).__name__ != LEAN
            key = (t.shape, True, t.dtype, t.device, freqs.shape, freqs.stride(), freqs.dtype, freqs.device, False)
            assert plans[key] is False
        t = torch.randn(4, 2, 2, 8, device=dev, requires_grad=True)
        f = torch.rand(4, 1, 1, 8, device=dev)
        assert type(R.fused_rope(t, f).grad_fn).__name__ == LEAN
        assert type(R.fused_rope(t, f.requires_grad_()).grad_fn).__name__ == "_DirectSBHDBackward"
        f.requires_grad_(False)
        y = R.fused_rope(t, f, 1)
        assert type(y.grad_fn).__name__ == "_DirectSBHDBackward" and not y.is_contiguous()


def test_a_bad_call_after_a_warm_one_still_raises(triton_device):
    dev = triton_device
    t = torch.randn(4, 2, 3, 8, device=dev, requires_grad=True)
    f = torch.rand(4, 1, 1, 8, device=dev)
    with apex.backend("triton"):
        R.fused_rope(t, f)
        R.fused_rope(t, f)  # a hit
        with pytest.raises(ValueError, match="freqs has 3 positions but t has sequence length 4"):
            R.fused_rope(t, f[:3])
        with pytest.raises(ValueError, match="freqs's last dim \\(10\\) must be even and at most"):
            R.fused_rope(t, torch.rand(4, 1, 1, 10, device=dev))
        with pytest.raises(TypeError, match="freqs must be float32"):
            R.fused_rope(t, f.half())
        with pytest.raises(ValueError, match="freqs is on meta"):
            R.fused_rope(t, torch.rand(4, 1, 1, 8, device="meta"))
        with pytest.raises(ValueError, match="t must be a 4-D"):
            R.fused_rope(t[0], f)
        with pytest.raises(TypeError, match="t must be a torch.Tensor"):
            R.fused_rope([1.0], f)
        with pytest.raises(ValueError, match="freqs must have shape"):
            R.fused_rope(t, torch.rand(4, 2, 1, 8, device=dev))
        y = R.fused_rope(t, f)  # the plan is still there, and right
    assert type(y.grad_fn).__name__ == LEAN


def test_backward_of_a_saved_table_with_other_strides(triton_device):
    """A saved-tensor hook that gives the table back in another layout: the backward reads its strides (the
    general launcher), the same gradient."""
    dev = triton_device
    t = torch.randn(4, 2, 3, 8, device=dev, requires_grad=True)
    f = torch.rand(4, 1, 1, 8, device=dev) * 6
    dy = torch.randn(4, 2, 3, 8, device=dev)
    with apex.backend("triton"):
        (ref,) = torch.autograd.grad(R.fused_rope(t, f), t, dy)

    def pack(x):
        return x.detach().clone().as_strided(x.shape, (1, 1, 1, 4)).copy_(x) if x.dim() == 4 else x

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        y = R.fused_rope(t, f)
    assert type(y.grad_fn).__name__ == LEAN
    with apex.backend("triton"):
        (got,) = torch.autograd.grad(y, t, dy)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_compile_func_and_modes_take_the_general_path(triton_device, monkeypatch):
    """Under a dispatch mode, a torch.func transform or torch.compile the plan is not consulted (nothing
    planned under them); a backward building a graph takes the registered op."""
    from tests.ops._modes import Recorder

    dev = triton_device
    t = torch.randn(4, 2, 3, 8, device=dev, requires_grad=True)
    f = (torch.rand(4, 1, 1, 4, device=dev) * 6).repeat(1, 1, 1, 2)  # (orthogonal: the halves share angles)
    with apex.backend("triton"):
        ref = R.fused_rope(t, f)
        with Recorder() as rec:
            y = R.fused_rope(t, f)
        assert "apex::fused_rope" in rec.ops and type(y.grad_fn).__name__ != LEAN
        got = torch.func.vmap(lambda x: R.fused_rope(x, f))(t.detach().unsqueeze(0))[0]
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        seen = []
        lean = R._lean
        monkeypatch.setattr(R, "_lean", lambda *a: seen.append(torch.compiler.is_compiling()) or lean(*a))
        got = torch.compile(lambda x: R.fused_rope(x, f), backend="eager", fullgraph=False)(t)
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
        assert seen and all(seen)  # (traced: the entry saw is_compiling and returned None)
        (g,) = torch.autograd.grad(R.fused_rope(t, f).square().sum(), t, create_graph=True)
        assert g.grad_fn is not None  # (the registered op: a graph for the second derivative)
        (gg,) = torch.autograd.grad(g.sum(), t)
        torch.testing.assert_close(gg, torch.full_like(gg, 2.0), rtol=1e-5, atol=1e-5)


def test_the_plan_respects_a_tuning_override(triton_device):
    """An override entered after a layout was planned (between a forward and its backward too) is the one
    the launches take, as the general launcher's."""
    from apex._kernels import _tuning

    dev = triton_device
    t = torch.randn(4, 2, 4, 16, device=dev, requires_grad=True)
    f = torch.rand(4, 1, 1, 16, device=dev) * 6
    dy = torch.randn(4, 2, 4, 16, device=dev)
    with apex.backend("triton"):
        ref_y = R.fused_rope(t, f)
        (ref,) = torch.autograd.grad(ref_y, t, dy)
        y = R.fused_rope(t, f)
        with _tuning.override("fused_rope.bwd", heads=1, warps=1):
            (got,) = torch.autograd.grad(y, t, dy)
            assert _tuning.last["fused_rope.bwd"]["heads"] == 1
        with _tuning.override("fused_rope.fwd", heads=2, warps=2):
            y2 = R.fused_rope(t, f)
            assert _tuning.last["fused_rope.fwd"]["heads"] == 2
        R.fused_rope(t, f)
        assert _tuning.last["fused_rope.fwd"]["heads"] != 2
    for p, q in ((got, ref), (y2, ref_y)):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_the_lean_path_is_taken(triton_device, monkeypatch):
    """A warm call launches from its plan: neither the checks nor the general launcher run."""
    from apex._kernels import fused_rope as K

    dev = triton_device
    t = torch.randn(4, 2, 3, 8, device=dev, requires_grad=True)
    f = torch.rand(4, 1, 1, 8, device=dev)
    with apex.backend("triton"):
        R.fused_rope(t, f)  # the misses: planned
        R.fused_rope(t, f, True)
        for name, owner in (("check_sbhd", R), ("rope", K), ("_rotated", R)):
            monkeypatch.setattr(owner, name, lambda *a, name=name, **k: pytest.fail(f"{name} ran"))
        monkeypatch.setattr(R._lean.__self__, "check", lambda *a: pytest.fail("check ran"))
        y = R.fused_rope(t, f)
        torch.autograd.grad(y, t, torch.ones_like(y))
        with torch.no_grad():
            R.fused_rope(t, f, True)
    assert type(y.grad_fn).__name__ == LEAN


@pytest.mark.parametrize("tr", [False, True])
@pytest.mark.parametrize("override", [False, True])
def test_the_launches_are_the_general_paths(triton_device, monkeypatch, tr, override):
    """The same launches (grid, arguments, warps) as the general launcher, forward and backward, with a
    backward whose configuration (head block, warps, tile) differs from the forward's."""
    import contextlib

    from apex._kernels import _tuning
    from apex._kernels import fused_rope as K

    dev = triton_device
    t = torch.randn(4, 2, 16, 4, device=dev).transpose(2, 3).requires_grad_()  # (strided: hd swapped)
    f = torch.rand(4, 1, 1, 12, device=dev)
    dy = torch.randn(2, 4, 4, 16, device=dev).transpose(0, 1)
    bwd = _tuning.override("fused_rope.bwd", heads=1, warps=2, halves=0) if override else contextlib.nullcontext()
    with apex.backend("triton"), bwd:
        R.fused_rope(t, f, tr)  # planned
        got = record_launches(monkeypatch, [K._rope_freqs_kernel, K._rope_kernel])
        for g in (dy, dy.contiguous()):
            torch.autograd.grad(R.fused_rope(t, f, tr), t, g)
        with monkeypatch.context() as m:
            m.setattr(R, "_lean", lambda *a: None)
            want = record_launches(m, [K._rope_freqs_kernel, K._rope_kernel])
            for g in (dy, dy.contiguous()):
                torch.autograd.grad(R.fused_rope(t, f, tr), t, g)
    assert len(got) == 4 and got == want
