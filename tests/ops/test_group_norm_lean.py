"""The planned eager Triton path of group_norm (apex.ops._group_norm_direct): the same bits as the general path
for every layout it plans, a new plan wherever a fact the checks or launches read changes, the general path's
errors after a warm call, and the general path wherever a plan must not stand (compiling, dispatch modes,
torch.func, subclasses)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import apex
from apex.ops import group_norm as GN
from tests import _device
from tests.ops._lean import same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")

PLANNED = "_PlannedGroupNormBackward"


def _table():
    return GN._lean.__self__.table.plans


def _run(x, groups, w, b, act, dy):
    """Output and the gradients of every leaf that requires one."""
    y = GN.group_norm(x, groups, w, b, 1e-5, act)
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    grads = list(torch.autograd.grad(y, leaves, dy)) if leaves and y.requires_grad else []
    return y, grads


def _both(monkeypatch, x, groups, w, b, act, dy):
    """``(lean, general)``: the call on the planned path, then on the general path (the plan lookup switched
    off), each on its own copies of the leaves."""
    def leaf(t):
        return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)

    lean = _run(leaf(x), groups, leaf(w), leaf(b), act, dy)
    with monkeypatch.context() as m:
        m.setattr(GN, "_lean", lambda *args: None)
        general = _run(leaf(x), groups, leaf(w), leaf(b), act, dy)
    return lean, general


def _same(a, b):
    same_run(a, b)


def _input(kind, dtype, dev):
    """``(x, groups)`` in the layout ``kind``."""
    if kind == "nchw":
        return torch.randn(2, 8, 3, 5, device=dev).to(dtype), 4
    if kind == "channels_last":
        return torch.randn(2, 8, 3, 5, device=dev).to(dtype).to(memory_format=torch.channels_last), 2
    if kind == "channels_last_3d":
        return torch.randn(2, 6, 2, 3, 2, device=dev).to(dtype).to(memory_format=torch.channels_last_3d), 3
    if kind == "3d":
        return torch.randn(3, 6, 7, device=dev).to(dtype), 2
    if kind == "copied":  # neither NCHW nor NHWC: the general path's contiguous copy
        return torch.randn(2, 8, 6, 5, device=dev).to(dtype)[:, :, ::2], 4
    # contiguous, with a size-1 dim of another stride (a transpose of one): the strides follow from the shape
    x = torch.randn(2, 8, 1, 5, device=dev).to(dtype).transpose(2, 3)
    assert x.is_contiguous() and x.stride()[-1] != 1
    return x, 4


KINDS = ["nchw", "channels_last", "channels_last_3d", "3d", "copied", "size1_stride"]
DTYPES = {"fp32": (torch.float32, torch.float32), "fp16": (torch.float16, torch.float16),
          "bf16": (torch.bfloat16, torch.bfloat16), "bf16_fp32_params": (torch.bfloat16, torch.float32)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtypes", DTYPES)
@pytest.mark.parametrize("affine,act", [("grad", "silu"), ("no-grad", ""), ("none", "silu"), ("grad", "")])
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, kind, dtypes, affine, act):
    dtype, pdtype = DTYPES[dtypes]
    with apex.backend("triton"):
        for _ in range(2):  # a miss, then a hit: fresh values each time
            x, groups = _input(kind, dtype, triton_device)
            x.requires_grad_()
            c = x.shape[1]
            w = b = None
            if affine != "none":
                w = (1 + 0.3 * torch.randn(c, device=triton_device)).to(pdtype).requires_grad_(affine == "grad")
                b = (0.2 * torch.randn(c, device=triton_device)).to(pdtype).requires_grad_(affine == "grad")
            dy = torch.randn(x.shape, device=triton_device).to(dtype)
            lean, general = _both(monkeypatch, x, groups, w, b, act, dy)
            assert type(lean[0].grad_fn).__name__ == PLANNED
            _same(lean, general)
            ref = F.group_norm(x.detach().double(), groups, *(p.detach().double() if p is not None else None
                                                              for p in (w, b)), 1e-5)
            ref = F.silu(ref) if act else ref
            tol = 1e-5 if dtype is torch.float32 else 2e-2
            torch.testing.assert_close(lean[0].double(), ref, rtol=tol, atol=tol)


def test_the_lean_path_is_taken(triton_device, monkeypatch):
    """A warm call launches from its plan: neither the checks nor the registered op run (a call that took
    the general path would fail here)."""
    x = torch.randn(2, 16, 4, 4, device=triton_device).to(memory_format=torch.channels_last).requires_grad_()
    w, b = torch.randn(16, device=triton_device, requires_grad=True), torch.randn(16, device=triton_device,
                                                                                  requires_grad=True)
    with apex.backend("triton"):
        GN.group_norm(x, 4, w, b)  # the plan

        def fail(*args, **kwargs):
            raise AssertionError("the general path ran")

        lean = GN._lean.__self__
        monkeypatch.setattr(lean, "check", fail)
        for name in ("check_args", "_fwd_op", "_bwd_op", "_backward_checked", "_forward_checked"):
            monkeypatch.setattr(GN, name, fail)
        y = GN.group_norm(x, 4, w, b)
        assert type(y.grad_fn).__name__ == PLANNED
        torch.autograd.grad(y, (x, w, b), torch.randn_like(y))
        with torch.no_grad():
            GN.group_norm(x, 4, w, b)


def test_the_module_entry_takes_the_lean_path(triton_device):
    from apex.contrib.group_norm import GroupNorm

    mod = GroupNorm(4, 16, act="silu").to(triton_device)
    x = torch.randn(2, 16, 3, 3, device=triton_device).to(memory_format=torch.channels_last).requires_grad_()
    with apex.backend("triton"):
        for _ in range(2):
            y = mod(x)
            assert type(y.grad_fn).__name__ == PLANNED
            y.sum().backward()


def test_a_changed_fact_takes_another_plan(triton_device, monkeypatch):
    """After a warm call, each change of a fact the checks or launches read (shape, strides, dtype, num_groups,
    act, the parameters present or absent, their dtype) gives the general path's values from a plan of its own."""
    dev = triton_device
    base = torch.randn(2, 8, 3, 3, device=dev)

    def params(c, dtype=torch.float32):
        return torch.randn(c, device=dev).to(dtype), torch.randn(c, device=dev).to(dtype)

    variants = [
        (base, 4, *params(8), ""),
        (torch.randn(3, 8, 3, 3, device=dev), 4, *params(8), ""),  # N
        (torch.randn(2, 8, 3, 4, device=dev), 4, *params(8), ""),  # spatial size
        (torch.randn(2, 12, 3, 3, device=dev), 4, *params(12), ""),  # channels
        (base, 2, *params(8), ""),  # num_groups
        (base, 4, *params(8), "silu"),  # act
        (base, 4, *params(8), "SiLU"),  # act, spelled otherwise
        (base, 4, *params(8), None),  # act None
        (base, 4, None, None, ""),  # no parameters
        (base.half(), 4, *params(8, torch.half), ""),  # dtype
        (base.half(), 4, *params(8), ""),  # the parameters' dtype
        (base.to(memory_format=torch.channels_last), 4, *params(8), ""),  # strides
        (base.view(2, 8, 9), 4, *params(8), ""),  # rank
    ]
    before = sum(1 for p in _table().values() if p)
    with apex.backend("triton"):
        for x, groups, w, b, act in variants:
            for grads in ((True, True), (True, False), (False, True)):
                xx = x.detach().requires_grad_(grads[0])
                ww = None if w is None else w.detach().requires_grad_(grads[1])
                bb = None if b is None else b.detach().requires_grad_(grads[1])
                if not any(t is not None and t.requires_grad for t in (xx, ww, bb)):
                    continue
                _same(*_both(monkeypatch, xx, groups, ww, bb, act, torch.randn_like(x)))
            with torch.no_grad():  # no graph: the plan's forward alone
                lean = GN.group_norm(x, groups, w, b, 1e-5, act)
            with monkeypatch.context() as m:
                m.setattr(GN, "_lean", lambda *args: None)
                torch.testing.assert_close(lean, GN.group_norm(x, groups, w, b, 1e-5, act), rtol=0, atol=0)
    assert sum(1 for p in _table().values() if p) - before >= len(variants) - 1


def test_a_parameter_whose_data_changes_takes_another_plan(triton_device, monkeypatch):
    """``param.data = ...`` changes a parameter's dtype (or shape) without changing the parameter or its version:
    the key reads the parameters' facts at every call."""
    dev = triton_device
    w = torch.nn.Parameter(torch.randn(8, device=dev))
    b = torch.nn.Parameter(torch.randn(8, device=dev))
    x = torch.randn(2, 8, 3, 3, device=dev, dtype=torch.half)
    dy = torch.randn_like(x)
    with apex.backend("triton"):
        GN.group_norm(x, 4, w, b)  # fp32 parameters with a half input: a plan
        w.data, b.data = w.data.half(), b.data.half()
        lean = _run(x, 4, w, b, "", dy)
        assert type(lean[0].grad_fn).__name__ == PLANNED and lean[1][0].dtype == torch.half
        with monkeypatch.context() as m:
            m.setattr(GN, "_lean", lambda *args: None)
            _same(lean, _run(x, 4, w, b, "", dy))
        w.data = torch.randn(6, device=dev)
        with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
            GN.group_norm(x, 4, w, b)


def test_unplanned_calls_take_the_general_path(triton_device):
    """fp64 (the PyTorch path), an empty input, groups wider than the kernels: kept as False; a num_groups that is
    no exact int and an act that is no str are not even keyed. Every one gives the general path's result."""
    from apex._kernels import group_norm as kernels

    dev = triton_device
    plans = _table()
    with apex.backend("triton"):
        GN.group_norm(torch.randn(2, 4, 3, device=dev, requires_grad=True), 2)  # (a planned call: a launch)
        for x, groups in ((torch.randn(2, 4, 3, dtype=torch.float64, device=dev), 2),
                          (torch.randn(0, 4, 3, device=dev), 2),
                          (torch.randn(1, kernels.MAX_GROUP_CHANNELS + 1, 1, device=dev), 1)):
            x.requires_grad_()
            y = GN.group_norm(x, groups)
            assert type(y.grad_fn).__name__ != PLANNED
            key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, x.device, groups, "")
            assert plans[key] is False
        np = pytest.importorskip("numpy")
        x = torch.randn(2, 4, 3, device=dev, requires_grad=True)
        y = GN.group_norm(x, np.int64(2))
        assert type(y.grad_fn).__name__ != PLANNED
        torch.testing.assert_close(y, GN.group_norm(x, 2), rtol=0, atol=0)


def _error(fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 (compared below)
        return type(exc), str(exc)
    return None


def test_a_bad_call_after_a_warm_one_raises_the_general_paths_error(triton_device, monkeypatch):
    dev = triton_device
    x = torch.randn(2, 8, 3, 3, device=dev, requires_grad=True)
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    bad = [
        lambda: GN.group_norm(x, True, w, b),  # a bool is an int, not a num_groups
        lambda: GN.group_norm(x, 0, w, b),
        lambda: GN.group_norm(x, 3, w, b),  # does not divide C
        lambda: GN.group_norm(x, 4.0, w, b),
        lambda: GN.group_norm(x, 4, torch.randn(6, device=dev), b),
        lambda: GN.group_norm(x, 4, w.detach().long(), b),
        lambda: GN.group_norm(x, 4, torch.randn(8, device="meta"), b),
        lambda: GN.group_norm(x, 4, w, None),
        lambda: GN.group_norm(x, 4, None, b),
        lambda: GN.group_norm(x, 4, w, b, 1e-5, "relu"),
        lambda: GN.group_norm(x, 4, w, b, 1e-5, 3),
        lambda: GN.group_norm(x, 4, w, b, "eps"),
        lambda: GN.group_norm(x.detach().long(), 4),
        lambda: GN.group_norm(torch.randn(8, device=dev), 4),
        lambda: GN.group_norm("x", 4),
        lambda: GN.group_norm(x, 4, [1.0] * 8, b),
    ]
    with apex.backend("triton"):
        GN.group_norm(x, 4, w, b)
        GN.group_norm(x, 4, w, b)  # a hit
        errors = [_error(fn) for fn in bad]
        with monkeypatch.context() as m:
            m.setattr(GN, "_lean", lambda *args: None)
            assert errors == [_error(fn) for fn in bad]
        assert all(e is not None for e in errors)
        y = GN.group_norm(x, 4, w, b)  # the plan is still there, and right
        assert type(y.grad_fn).__name__ == PLANNED


def test_compile_modes_func_and_subclasses_take_the_general_path(triton_device, monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    from apex.ops import _group_norm_direct as D

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    dev = triton_device
    x = torch.randn(2, 8, 3, 3, device=dev, requires_grad=True)
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    with apex.backend("triton"):
        ref = GN.group_norm(x, 4, w, b)
        assert type(ref.grad_fn).__name__ == PLANNED
        with Passing():
            y = GN.group_norm(x, 4, w, b)
        assert type(y.grad_fn).__name__ != PLANNED
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        y = GN.group_norm(x.detach().as_subclass(Sub).requires_grad_(), 4, w, b)
        assert type(y.grad_fn).__name__ != PLANNED
        seen = []

        def f(t):  # (the registered op has no torch.func rule: what matters is that no plan runs there)
            seen.append(GN._lean(t, 4, w, b, 1e-5, ""))
            return t.sum()

        torch.func.grad(f)(x.detach())
        assert seen == [None]
        with monkeypatch.context() as m:  # what torch.compile and torch.export see
            m.setattr(D, "_is_compiling", lambda: True)
            assert D.Lean.run(GN._lean.__self__, x, 4, w, b, 1e-5, "") is None


def test_double_backward_takes_the_registered_op(triton_device):
    """A graph of the gradient (create_graph) is the registered backward op's: its error, as before."""
    dev = triton_device
    x = torch.randn(2, 8, 3, 3, device=dev, requires_grad=True)
    with apex.backend("triton"):
        y = GN.group_norm(x, 4)
        assert type(y.grad_fn).__name__ == PLANNED
        (gx,) = torch.autograd.grad(y, x, torch.randn_like(y), create_graph=True)
        with pytest.raises(RuntimeError):
            torch.autograd.grad(gx.sum(), x)


def test_limits_and_overrides_empty_the_plans(triton_device, monkeypatch):
    """A change of the kernels' tile limits (or an override, an assumed device) empties the plans: the next call,
    and the backward of a forward made before it, launch with the new tiles (here the split path)."""
    from apex._kernels import _tuning
    from apex._kernels import group_norm as kernels
    from apex.testing import TritonTrace

    dev = triton_device
    x = torch.randn(2, 8, 9, 7, device=dev).to(memory_format=torch.channels_last).requires_grad_()
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    dy = torch.randn_like(x)
    with apex.backend("triton"):
        ref = _run(x, 2, w, b, "", dy)
        y = GN.group_norm(x, 2, w, b)  # its backward after the change
        assert _table()
        monkeypatch.setitem(kernels.LIMITS, "tile", 128)
        monkeypatch.setitem(kernels.LIMITS, "fuse_max", 32)
        assert not _table()
        with TritonTrace(bounds=False) as tr:
            got = torch.autograd.grad(y, (x, w, b), dy)
        assert tr.launches == 3  # backward sums + dx + the parameter gradients' sum (the split path)
        with TritonTrace(bounds=False) as tr:
            split = _run(x, 2, w, b, "", dy)
        assert tr.launches == 5 and type(split[0].grad_fn).__name__ == PLANNED
        with monkeypatch.context() as m:
            m.setattr(GN, "_lean", lambda *args: None)
            _same(split, _run(x, 2, w, b, "", dy))
        with _tuning.override("group_norm_unused", rows=1):
            assert not _table()
            _same(_run(x, 2, w, b, "", dy), split)
    for p, q in zip(got, ref[1]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-5)  # (another summation order)


def test_backward_of_a_saved_input_with_other_strides(triton_device):
    """A saved-tensor hook that gives the input back in another layout: the backward lays it out as the general
    path does, the same gradients."""
    dev = triton_device
    x = torch.randn(2, 8, 3, 5, device=dev, requires_grad=True)
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    dy = torch.randn(2, 8, 3, 5, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(GN.group_norm(x, 4, w, b), (x, w, b), dy)

    def pack(t):  # the input in a layout neither NCHW nor NHWC
        return t.detach().transpose(2, 3).contiguous().transpose(2, 3) if t.dim() == 4 else t

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = GN.group_norm(x, 4, w, b)
    with apex.backend("triton"):
        got = torch.autograd.grad(y, (x, w, b), dy)
    for p, q in zip(got, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
