"""The planned eager Triton path of the dense chains (apex.ops._dense_direct: FusedDense, FusedDenseGeluDense, MLP
and their functional forms): the same bits and launches as the general path, taken on a hit without the general
path or the key, a new plan (or the general path's error) wherever a fact changes (a parameter's ``.data``
swapped too), and the general path under autocast, no_grad, double backward, saved-tensor hooks, another
backend, dispatch modes and torch.func."""

from __future__ import annotations

import pytest
import torch

import apex
from apex.fused_dense import fused_dense as FD
from apex.mlp import mlp as MM
from apex.ops import _dense_direct as D
from apex.ops import fused_dense as OF
from tests import _device
from tests.ops._lean import record_launches, same_run, same_tensors

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the general path by design")

LEAN = "_DirectChainBackward"
CASES = {  # name: (module builder, lean entry patched off for the general path)
    "dense": lambda: FD.FusedDense(7, 5),
    "dense-nobias": lambda: FD.FusedDense(7, 5, bias=False),
    "gelu-dense": lambda: FD.FusedDenseGeluDense(7, 9, 5),
    "mlp1-none": lambda: MM.MLP([7, 5], activation="none"),
    "mlp2-relu": lambda: MM.MLP([7, 9, 5], activation="relu"),
    "mlp2-sigmoid-nobias": lambda: MM.MLP([7, 9, 5], bias=False, activation="sigmoid"),
    "mlp3-relu": lambda: MM.MLP([7, 9, 6, 5], activation="relu"),
    "mlp3-none-nobias": lambda: MM.MLP([7, 9, 6, 5], bias=False, activation="none"),
}


def _general(m) -> None:
    """Every lean entry answers None (the general path takes every call) within the monkeypatch context ``m``."""
    for mod, name in ((FD, "_lean_dense"), (FD, "_lean_chain"), (MM, "_lean_chain"), (OF, "_lean_chain")):
        m.setattr(mod, name, lambda *args: None)


def _run(module, x, dy):
    """Output and the gradients of every leaf that needs one."""
    leaves = [t for t in (x, *module.parameters()) if t.requires_grad]
    y = module(x)
    return y, list(torch.autograd.grad(y, leaves, dy)) if leaves else []


def _both(monkeypatch, module, x, dy):
    lean = _run(module, x, dy)
    with monkeypatch.context() as m:
        _general(m)
        general = _run(module, x, dy)
    return lean, general


def _make(case, dev, dtype=torch.float32):
    torch.manual_seed(0)
    return CASES[case]().to(dev, dtype)


# Every case in fp32, half of them in each half dtype, 2-D and 3-D inputs (kept few: the interpreter's GEMMs take
# their time).
LAYOUTS = [(c, torch.float32, (6, 7)) for c in CASES]
LAYOUTS += [(c, torch.bfloat16, (2, 3, 7)) for c in ("dense-nobias", "gelu-dense", "mlp2-sigmoid-nobias", "mlp3-relu")]
LAYOUTS += [(c, torch.float16, (6, 7)) for c in ("dense", "mlp1-none", "mlp2-relu", "mlp3-none-nobias")]
LAYOUTS += [(c, torch.float32, (2, 3, 7)) for c in ("dense", "mlp2-relu")]


@pytest.mark.parametrize("case,dtype,shape", LAYOUTS, ids=str)
def test_lean_path_matches_the_general_path_bit_for_bit(triton_device, monkeypatch, case, dtype, shape):
    module = _make(case, triton_device, dtype)
    x = torch.randn(shape, device=triton_device).to(dtype).requires_grad_()
    dy = torch.randn(*shape[:-1], 5, device=triton_device).to(dtype)
    with apex.backend("triton"):
        with monkeypatch.context() as m:
            _general(m)
            want = _run(module, x, dy)
            with torch.no_grad():
                y_want = module(x)
        for _ in range(2):  # a miss (the key), then a hit (the guard)
            got = _run(module, x, dy)
            assert type(got[0].grad_fn).__name__ == LEAN and type(want[0].grad_fn).__name__ != LEAN
            same_run(got, want)
        with torch.no_grad():  # the plan's forward alone
            same_tensors([module(x)], [y_want])


@pytest.mark.parametrize("case,needs", [("dense", "all"), ("dense", "input"), ("dense", "params"),
                                        ("gelu-dense", "all"), ("mlp2-relu", "input"), ("mlp2-relu", "params"),
                                        ("mlp3-relu", "all")])
def test_a_hit_takes_neither_the_general_path_nor_the_key(triton_device, monkeypatch, case, needs):
    module = _make(case, triton_device)
    module.requires_grad_(needs != "input")
    x = torch.randn(6, 7, device=triton_device, requires_grad=needs != "params")
    dy = torch.randn(6, 5, device=triton_device)
    with apex.backend("triton"):
        want = _run(module, x, dy)
        _run(module, x, dy)  # (the backward's guard made)

        def fail(*args, **kwargs):
            raise AssertionError("not on a hit")

        with monkeypatch.context() as m:
            for mod, name in ((FD, "apply_general"), (MM, "apply_general"), (OF, "apply_general"),
                              (OF, "_backward_triton"), (D, "_dense_plan"), (D, "_chain_plan"),
                              (D, "_general_backward")):
                m.setattr(mod, name, fail)
            m.setattr(D._LOADED[0].ChainPlan, "backward_steps", fail)
            got = _run(module, x, dy)
    assert type(got[0].grad_fn).__name__ == LEAN
    same_run(got, want)


@pytest.mark.parametrize("case", ["dense", "dense-nobias", "gelu-dense", "mlp2-sigmoid-nobias", "mlp3-relu"])
def test_the_plan_launches_what_the_general_path_launches(triton_device, monkeypatch, case):
    from apex._kernels import fused_dense as K

    module = _make(case, triton_device)
    x = torch.randn(2, 3, 7, device=triton_device, requires_grad=True)
    dy = torch.randn(2, 3, 5, device=triton_device)
    with apex.backend("triton"):
        _run(module, x, dy)  # (planned)
        got = record_launches(monkeypatch, [K._gemm_kernel])
        _run(module, x, dy)
        _run(module, x, dy)  # (the backward's guard taken)
        with monkeypatch.context() as m:
            _general(m)
            want = record_launches(m, [K._gemm_kernel])
            _run(module, x, dy)
            _run(module, x, dy)
    assert got and got == want


def test_a_parameters_data_swapped_is_read_again(triton_device, monkeypatch):
    """``param.data = ...`` changes a parameter's dtype, shape or layout without changing the parameter: the next
    call is planned for its new facts, or fails as the general path does."""
    dev = triton_device
    dense = _make("dense", dev)
    x = torch.randn(4, 7, device=dev, requires_grad=True)
    dy = torch.randn(4, 5, device=dev)
    with apex.backend("triton"):
        _both(monkeypatch, dense, x, dy)
        data = dense.weight.data
        dense.weight.data = data.t().contiguous().t()  # the same values at strides (1, 5)
        lean, general = _both(monkeypatch, dense, x, dy)
        assert type(lean[0].grad_fn).__name__ == LEAN
        same_run(lean, general)
        for name, change, err, match in [("weight", lambda t: t.half(), TypeError, "weight 0 has dtype"),
                                         ("weight", lambda t: t[:, :6], ValueError, "weight 0 expects 6 input"),
                                         ("bias", lambda t: t.half(), TypeError, "bias 0 has dtype"),
                                         ("bias", lambda t: t[:3], ValueError, "bias 0 must have shape")]:
            p = getattr(dense, name)
            saved = p.data
            p.data = change(data if name == "weight" else saved)
            with pytest.raises(err, match=match):
                dense(x)
            p.data = saved
        dense.weight.data = data
        same_run(*_both(monkeypatch, dense, x, dy))
        # An MLP's weight swapped for another layout between a forward and its backward: read as it is then.
        mlp = _make("mlp2-relu", dev)
        _both(monkeypatch, mlp, x, dy)
        want = _run(mlp, x, dy)
        y = mlp(x)
        w = mlp.weight_1.data
        mlp.weight_1.data = w.t().contiguous().t()
        got = y, list(torch.autograd.grad(y, [x, *mlp.parameters()], dy))
        mlp.weight_1.data = w
        same_run(got, want, strides=False)


def test_a_bad_call_after_a_warm_one_still_raises(triton_device):
    dev = triton_device
    dense, mlp = _make("dense", dev), _make("mlp2-relu", dev)
    x = torch.randn(4, 7, device=dev, requires_grad=True)
    with apex.backend("triton"):
        for module in (dense, mlp):
            module(x)
            module(x)  # a hit
            with pytest.raises(ValueError, match="weight 0 expects 7 input features"):
                module(torch.randn(4, 6, device=dev))
            with pytest.raises(TypeError, match="input must be a floating"):
                module(torch.ones(4, 7, dtype=torch.int32, device=dev))
            with pytest.raises(TypeError, match="weight 0 has dtype"):
                module(x.detach().half())
            with pytest.raises(TypeError, match="input must be a torch.Tensor"):
                module("x")
            assert type(module(x).grad_fn).__name__ == LEAN  # the plan is still there


@pytest.mark.parametrize("case", ["dense", "mlp2-relu"])
def test_fallbacks(triton_device, monkeypatch, case):
    """no_grad, autocast, another backend, dispatch modes and torch.func after warm calls: the general path's
    results (the plan's forward alone under no_grad)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    dev = triton_device
    module = _make(case, dev)
    x = torch.randn(4, 7, device=dev, requires_grad=True)
    dy = torch.randn(4, 5, device=dev)

    def general(fn):
        with monkeypatch.context() as m:
            _general(m)
            return fn()

    with apex.backend("triton"):
        _run(module, x, dy)
        _run(module, x, dy)  # warm: the guards made
        with torch.no_grad():
            y = module(x)
        assert y.grad_fn is None
        same_tensors([y], [general(lambda: module(x)).detach()])
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            lean = _run(module, x, dy.bfloat16())
            want = general(lambda: _run(module, x, dy.bfloat16()))
        assert lean[0].dtype == torch.bfloat16 and type(lean[0].grad_fn).__name__ != LEAN
        same_run(lean, want)
        with Passthrough():
            y = module(x)
        assert type(y.grad_fn).__name__ != LEAN
        same_tensors([y], [module(x)])
        seen = []

        def f(t):  # under a torch.func transform the lean entries decline (the general path's Function)
            p = [q.detach() for q in module.parameters()]
            seen.append(D.dense(t, *p) if case == "dense" else D.chain((1, 1), (t, *p[::2], *p[1::2]), 2))
            return t.sum()

        torch.func.grad(f)(x.detach())
        assert seen == [None]
        assert type(module(x).grad_fn).__name__ == LEAN
    with apex.backend("torch"):  # the next call's backend is asked
        assert type(module(x).grad_fn).__name__ != LEAN
    with apex.backend("triton"):
        assert type(module(x).grad_fn).__name__ == LEAN


@pytest.mark.parametrize("case", ["dense", "mlp2-relu"])
def test_backward_fallbacks(triton_device, monkeypatch, case):
    """Double backward fails or answers as the general path's; saved tensors a hook gives back in another layout,
    a backward under a dispatch mode and a backward after ``_tuning.invalidate`` give the general path's
    gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from apex._kernels import _tuning

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    dev = triton_device
    module = _make(case, dev)
    x = torch.randn(4, 7, device=dev, requires_grad=True)
    dy = torch.randn(4, 5, device=dev)
    leaves = [x, *module.parameters()]

    def second(lean):
        with monkeypatch.context() as m:
            if not lean:
                _general(m)
            try:
                gx, = torch.autograd.grad(module(x).square().sum(), x, create_graph=True)
                return None, torch.autograd.grad(gx.sum(), leaves[1:], allow_unused=True)
            except Exception as exc:  # noqa: BLE001 (the same error either way)
                return type(exc), str(exc)[:60]

    with apex.backend("triton"):
        want = _run(module, x, dy)
        _run(module, x, dy)
        a, b = second(True), second(False)
        assert a[0] is b[0] and (a[1] == b[1] if a[0] else all(p is None for p in a[1]) or a[1] == b[1])

        def unpack(t):
            return t.t().contiguous().t() if t.dim() == 2 else t.clone()

        for _ in range(2):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                y = module(x)
            assert type(y.grad_fn).__name__ == LEAN
            same_run((y, list(torch.autograd.grad(y, leaves, dy))), want, strides=False)
        y = module(x)
        with Passthrough():
            got = torch.autograd.grad(y, leaves, dy)
        same_tensors(got, want[1])
        y = module(x)
        _tuning.invalidate()
        same_tensors(torch.autograd.grad(y, leaves, dy), want[1])
        same_run(_run(module, x, dy), want)


def test_functional_forms_take_the_plan(triton_device, monkeypatch):
    from apex.mlp import mlp_function

    dev = triton_device
    dense, mlp = _make("dense", dev), _make("mlp2-relu", dev)
    x = torch.randn(4, 7, device=dev, requires_grad=True)
    with apex.backend("triton"):
        for _ in range(2):
            y = FD.fused_dense_function(x, dense.weight, dense.bias)
            z = mlp_function(1, 1, x, *mlp.weights, *mlp.biases)
            assert type(y.grad_fn).__name__ == LEAN and type(z.grad_fn).__name__ == LEAN
        with monkeypatch.context() as m:
            _general(m)
            same_tensors([y, z], [FD.fused_dense_function(x, dense.weight, dense.bias),
                                  mlp_function(1, 1, x, *mlp.weights, *mlp.biases)])
