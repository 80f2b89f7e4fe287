"""The planned eager Triton path of OpenFold's LayerNorm (apex.ops._openfold_ln_direct, taken by
``LayerNormSmallShapeOptImpl.apply``): the same bits and launches as the general path for every layout it plans, a
new plan wherever a fact the checks or launches read changes (a parameter's ``.data`` swapped too), the general
path's errors after a warm call, and the general path where it must run (no plan, modes, torch.func, another
backend, saved-tensor hooks that change a layout, double backward)."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.contrib.openfold_triton import layer_norm as CL
from apex.ops import openfold_layer_norm as OL
from tests import _device
from tests.ops._lean import record_launches, same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the general path by design")

LEAN, GENERAL = "_DirectOpenFoldLayerNormBackward", "LayerNormSmallShapeOptImplBackward"
LN = CL.LayerNormSmallShapeOptImpl


def _leaf(t):
    return None if t is None else t.detach().clone().requires_grad_(t.requires_grad)


def _run(x, ns, w, b, dy, eps=1e-5):
    """Output and the gradients of every leaf that requires one."""
    y = LN.apply(x, ns, w, b, eps)
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    return y, (list(torch.autograd.grad(y, leaves, dy)) if leaves else [])


def _both(monkeypatch, x, ns, w, b, dy):
    lean = _run(_leaf(x), ns, _leaf(w), _leaf(b), dy)
    with monkeypatch.context() as m:
        m.setattr(CL, "_lean", lambda *args: None)
        general = _run(_leaf(x), ns, _leaf(w), _leaf(b), dy)
    return lean, general


def _input(kind, dtype, dev):
    """``(x, normalized_shape)``: rows read in place (2-D, a transposed 4-D view, a size-1 dim), or a 2-D view of a
    contiguous input (two normalised dims, 5-D)."""
    if kind == "2d":
        return torch.randn(7, 24, device=dev).to(dtype), (24,)
    if kind == "transposed-4d":
        return torch.randn(2, 5, 3, 24, device=dev).to(dtype).transpose(1, 2), 24
    if kind == "two-dims":
        return torch.randn(3, 4, 6, device=dev).to(dtype), [4, 6]
    if kind == "size-1":  # contiguous, with a stride of its own along the size-1 dim (which empty_like keeps)
        return torch.randn(4, 2, 24, device=dev).to(dtype)[:, :1], (24,)
    return torch.randn(2, 1, 3, 2, 24, device=dev).to(dtype), torch.Size([24])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind,params", [("2d", "grad"), ("transposed-4d", "no-grad"), ("two-dims", "weight-only"),
                                         ("5d", "none"), ("2d", "none"), ("transposed-4d", "grad"),
                                         ("size-1", "grad")], ids=str)
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, dtype, kind, params):
    for hit in (False, True):  # a miss, then a hit: fresh values each time
        x, ns = _input(kind, dtype, triton_device)
        x.requires_grad_()
        shape = (ns,) if isinstance(ns, int) else tuple(ns)
        w = (torch.rand(shape, device=triton_device) + 0.5).to(dtype).requires_grad_(params != "no-grad")
        b = torch.randn(shape, device=triton_device).to(dtype).requires_grad_(params != "no-grad")
        w, b = {"weight-only": (w, None), "none": (None, None)}.get(params, (w, b))
        dy = torch.randn(x.shape, device=triton_device).to(dtype)
        with apex.backend("triton"):
            lean, general = _both(monkeypatch, x, ns, w, b, dy)
            assert type(lean[0].grad_fn).__name__ == LEAN and type(general[0].grad_fn).__name__ == GENERAL
            same_run(lean, general)
            if not hit:
                continue
            with torch.no_grad():  # the plan's forward alone
                y = LN.apply(x, ns, w, b, 1e-5)
                with monkeypatch.context() as m:
                    m.setattr(CL, "_lean", lambda *args: None)
                    same_run((y, []), (LN.apply(x, ns, w, b, 1e-5), []))


def test_mixed_dtypes_match(triton_device, monkeypatch):
    """bf16 activations, fp32 parameters (their gradients fp32)."""
    dev = triton_device
    x = torch.randn(5, 3, 40, device=dev).to(torch.bfloat16).requires_grad_()
    w, b = torch.rand(40, device=dev).requires_grad_(), torch.randn(40, device=dev, requires_grad=True)
    dy = torch.randn(5, 3, 40, device=dev).to(torch.bfloat16)
    with apex.backend("triton"):
        for _ in range(2):
            lean, general = _both(monkeypatch, x, (40,), w, b, dy)
            assert type(lean[0].grad_fn).__name__ == LEAN and lean[1][1].dtype == torch.float32
            same_run(lean, general)


def test_launches_are_the_general_paths(triton_device, monkeypatch):
    """The planned path launches what the general path launches (kernels, grids, arguments as layouts)."""
    from apex._kernels import openfold_layer_norm as K

    dev = triton_device
    x = torch.randn(3, 4, 2, 24, device=dev).transpose(1, 2).requires_grad_()
    w, b = torch.randn(24, device=dev, requires_grad=True), torch.randn(24, device=dev, requires_grad=True)
    dy = torch.randn(x.shape, device=dev)
    if type(K._ln_fwd.fn).__name__ == "InterpretedFunction" and "run" not in vars(type(K._ln_fwd.fn)):
        pytest.skip("Triton 3.4's interpreter launches a warm kernel past its run method: nothing to record")
    with apex.backend("triton"):
        for lean in (True, False):  # warm: both paths' launches kept
            with monkeypatch.context() as m:
                if not lean:
                    m.setattr(CL, "_lean", lambda *args: None)
                _run(x, 24, w, b, dy)
                _run(x, 24, w.detach(), b, dy)
        kernels = [K._ln_fwd.fn, K._ln_bwd.fn, K._column_sum]
        got = record_launches(monkeypatch, kernels)
        _run(x, 24, w, b, dy)
        _run(x, 24, w.detach(), b, dy)  # another backward: dbias alone
        with monkeypatch.context() as m:
            m.setattr(CL, "_lean", lambda *args: None)
            want = record_launches(m, kernels)
            _run(x, 24, w, b, dy)
            _run(x, 24, w.detach(), b, dy)
    assert len(got) == 6 and got == want


def test_a_hit_runs_no_general_code(triton_device, monkeypatch):
    """A warm call's checks, routing and backward are the plan's: the general path is never entered."""
    dev = triton_device
    x = torch.randn(6, 16, device=dev, requires_grad=True)
    w, b = torch.randn(16, device=dev, requires_grad=True), torch.randn(16, device=dev, requires_grad=True)
    dy = torch.randn(6, 16, device=dev)
    with apex.backend("triton"):
        ref = _run(x, (16,), w, b, dy)

        def refuse(*args, **kwargs):
            raise AssertionError("the general path ran on a planned call")

        lean = OL._lean.__self__
        with monkeypatch.context() as m:
            for name in ("check_args", "forward_checked", "backward_checked", "use_kernel", "_c_apply", "_py_apply"):
                m.setattr(CL, name, refuse)
            m.setattr(lean, "check", refuse)
            m.setattr(lean, "general", refuse)
            got = _run(x, (16,), w, b, dy)
    same_run(got, ref)


def test_a_parameters_data_swapped_is_read_again(triton_device, monkeypatch):
    """``param.data = ...`` changes a parameter's dtype, shape or layout without changing the parameter: the next
    call is planned (or refused) for its new facts, with the general path's results and errors."""
    dev = triton_device
    x = torch.randn(4, 12, device=dev, requires_grad=True)
    w = torch.nn.Parameter(torch.rand(12, device=dev) + 0.5)
    b = torch.nn.Parameter(torch.randn(12, device=dev))
    dy = torch.randn(4, 12, device=dev)
    def both():
        lean = _run(x, (12,), w, b, dy)
        with monkeypatch.context() as m:
            m.setattr(CL, "_lean", lambda *args: None)
            return lean, _run(x, (12,), w, b, dy)

    with apex.backend("triton"):
        same_run(*both())
        w.data = w.data.half()  # a half weight with an fp32 input: another plan
        lean, general = both()
        assert type(lean[0].grad_fn).__name__ == LEAN and lean[1][1].dtype == torch.float16
        same_run(lean, general)
        w.data = torch.rand(24, device=dev)[::2]  # not contiguous: the general path copies it (not planned)
        lean, general = both()
        assert type(lean[0].grad_fn).__name__ == GENERAL
        same_run(lean, general)
        w.data = torch.ones(6, device=dev)  # the wrong shape: the general path's error
        with pytest.raises(ValueError, match="weight must have shape"):
            LN.apply(x, (12,), w, b, 1e-5)
        w.data = torch.ones(12, device=dev)
        assert type(LN.apply(x, (12,), w, b, 1e-5).grad_fn).__name__ == LEAN


def test_a_bad_call_after_a_warm_one_still_raises(triton_device, monkeypatch):
    dev = triton_device
    x = torch.randn(4, 8, device=dev, requires_grad=True)
    w, b = torch.randn(8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    with apex.backend("triton"):
        LN.apply(x, (8,), w, b, 1e-5)
        LN.apply(x, (8,), w, b, 1e-5)  # a hit
        with pytest.raises(ValueError, match="weight must have shape"):
            LN.apply(x, (8,), torch.randn(6, device=dev), b, 1e-5)
        with pytest.raises(ValueError, match="bias must have shape"):
            LN.apply(x, (8,), w, torch.randn(6, device=dev), 1e-5)
        with pytest.raises(ValueError, match="weight is on meta"):
            LN.apply(x, (8,), torch.randn(8, device="meta"), b, 1e-5)
        with pytest.raises(TypeError, match="inputs must be a floating-point tensor"):
            LN.apply(torch.ones(4, 8, dtype=torch.int64, device=dev), (8,), None, None, 1e-5)
        with pytest.raises(ValueError, match="must be a non-empty suffix"):
            LN.apply(x, (6,), None, None, 1e-5)
        with pytest.raises(TypeError, match="inputs must be a tensor"):
            LN.apply("x", (8,), None, None, 1e-5)
        # Forms the general path converts (never a key): its results.
        dy = torch.randn(4, 8, device=dev)
        for ns, eps in (((8.0,), 1e-5), ((8,), 1), ([8], 1e-5)):
            lean = _run(_leaf(x), ns, _leaf(w), _leaf(b), dy, eps)
            with monkeypatch.context() as m:
                m.setattr(CL, "_lean", lambda *args: None)
                same_run(lean, _run(_leaf(x), ns, _leaf(w), _leaf(b), dy, eps))
        y = LN.apply(x, (8,), w, b)  # the plan is still there, and right (eps defaults to 1e-5)
        assert type(y.grad_fn).__name__ == LEAN


def test_unplanned_layouts_take_the_general_path(triton_device):
    """fp64 (PyTorch's path), an empty input, rows longer than the kernels take and rows the general path copies
    are kept as False."""
    plans = OL._lean.__self__.table.plans
    dev = triton_device
    with apex.backend("triton"):
        LN.apply(torch.randn(2, 8, device=dev, requires_grad=True), (8,), None, None, 1e-5)  # (a launch)
        for x, ns in ((torch.randn(4, 6, dtype=torch.float64, device=dev), (6,)), (torch.randn(0, 6, device=dev), 6),
                      (torch.randn(2, 16385, device=dev), (16385,)),
                      (torch.randn(4, 6, 2, device=dev).transpose(1, 2), (2, 6))):  # a copy of rows
            x.requires_grad_()
            plans.clear()
            y = LN.apply(x, ns, None, None, 1e-5)
            assert type(y.grad_fn).__name__ == GENERAL
            assert list(plans.values()) == [False]


def test_backward_of_a_saved_input_with_other_strides(triton_device):
    """A saved-tensor hook that gives the input and weight back in another layout: the general backward reads
    them."""
    dev = triton_device
    x = torch.randn(6, 10, device=dev, requires_grad=True)
    w, b = torch.randn(10, device=dev, requires_grad=True), torch.randn(10, device=dev, requires_grad=True)
    dy = torch.randn(6, 10, device=dev)
    with apex.backend("triton"):
        ref = torch.autograd.grad(LN.apply(x, (10,), w, b, 1e-5), (x, w, b), dy)

    def pack(t):  # column-major inputs, a strided weight
        return t.detach().t().contiguous().t() if t.dim() == 2 else torch.stack([t, t], 1)[:, 0] if t is w else t

    with apex.backend("triton"), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = LN.apply(x, (10,), w, b, 1e-5)
    assert type(y.grad_fn).__name__ == LEAN
    with apex.backend("triton"):
        got = torch.autograd.grad(y, (x, w, b), dy)
    for p, q in zip(got, ref):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_another_backend_mode_or_transform_takes_the_general_path(triton_device):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    dev = triton_device
    x, w = torch.randn(4, 8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)
    with apex.backend("triton"):
        ref = LN.apply(x, (8,), w, None, 1e-5)
        assert type(ref.grad_fn).__name__ == LEAN
        with Passthrough():
            y = LN.apply(x, (8,), w, None, 1e-5)
        assert type(y.grad_fn).__name__ == GENERAL
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        seen = []

        def f(t):  # under a torch.func transform the lean path declines
            seen.append(OL._lean(t, (8,), w.detach(), None, 1e-5))
            return t.sum()

        torch.func.grad(f)(x.detach())
        assert seen == [None]
    with apex.backend("torch"):  # another backend: the general path (PyTorch's), then the plan again
        assert type(LN.apply(x, (8,), w, None, 1e-5).grad_fn).__name__ == GENERAL
    with apex.backend("triton"):
        assert type(LN.apply(x, (8,), w, None, 1e-5).grad_fn).__name__ == LEAN


def test_double_backward_fails_as_the_general_path_does(triton_device, monkeypatch):
    dev = triton_device
    x, w = torch.randn(4, 8, device=dev, requires_grad=True), torch.randn(8, device=dev, requires_grad=True)

    def second(lean):
        with monkeypatch.context() as m:
            if not lean:
                m.setattr(CL, "_lean", lambda *args: None)
            y = LN.apply(x, (8,), w, None, 1e-5)
            try:
                gx, = torch.autograd.grad(y.square().sum(), x, create_graph=True)
                gx.sum().backward()
            except Exception as exc:  # noqa: BLE001 (the same error either way)
                return type(exc), str(exc)[:80]
            return None, x.grad.clone()

    with apex.backend("triton"):
        a, b = second(True), second(False)
    assert a[0] is b[0] and (a[0] is None or a[1] == b[1])


def test_an_invalidation_between_forward_and_backward(triton_device, monkeypatch):
    """_tuning.invalidate (an override, an assumed device) between a forward and its backward: the backward looks
    its launch up again, as the general launcher would."""
    from apex._kernels import _tuning

    dev = triton_device
    x = torch.randn(16, 32, device=dev, requires_grad=True)
    w, b = torch.randn(32, device=dev, requires_grad=True), torch.randn(32, device=dev, requires_grad=True)
    dy = torch.randn(16, 32, device=dev)
    with apex.backend("triton"):
        _, ref = _both(monkeypatch, x, (32,), w, b, dy)
        y = LN.apply(x, (32,), w, b, 1e-5)
        _tuning.invalidate()
        got = torch.autograd.grad(y, (x, w, b), dy)
    same_run((y, list(got)), ref)
