"""The eager Triton path's cached chain plans (``apex.ops.fused_dense._lean``, ``ChainPlan``): a plan is keyed on
every fact it derives from, so a call that differs from a warm one in shape, strides, dtype, layout or which
inputs need a gradient gets its own plan and the right values; bad calls after a warm one fail as before; and
the plan's launches are the general path's, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import apex
from apex.fused_dense import FusedDense, FusedDenseFunc, FusedDenseGeluDense, FusedDenseGeluDenseFunc
from apex.mlp import MLP, MlpFunction
from apex.testing import assert_rel_close


def _kernels():
    from apex._kernels import fused_dense as K

    return K


def _chains():
    from apex._kernels import _fused_dense_chain as C

    return C


def _mlp64(x, ws, bs, act):
    for w, b in zip(ws, bs or [None] * len(ws)):
        x = F.linear(x, w, b)
        x = {0: x, 1: torch.relu(x), 2: torch.sigmoid(x)}[act]
    return x


def _check_mlp(mlp: MLP, x: torch.Tensor, dtype=torch.float32):
    """The MLP's output and gradients against float64 (the module's own parameters, whatever their layout)."""
    params = [x, *mlp.parameters()]
    y = mlp(x)
    dy = torch.randn(y.shape, device=y.device).to(y.dtype)
    g = torch.autograd.grad(y, [p for p in params if p.requires_grad], dy)
    p64 = [p.detach().double().requires_grad_(p.requires_grad) for p in params]
    n = mlp.num_layers
    named = dict(zip([name for name, _ in mlp.named_parameters()], p64[1:]))
    ws = [named[f"weight_{i}"] for i in range(n)]
    bs = [named[f"bias_{i}"] for i in range(n)] if mlp.bias else []
    ref = _mlp64(p64[0], ws, bs, mlp.activation)
    ref_g = torch.autograd.grad(ref, [p for p in p64 if p.requires_grad], dy.double())
    tol = 1e-5 if dtype == torch.float32 else None
    assert y.dtype == dtype and y.shape == ref.shape
    assert_rel_close(y, ref, dtype, tol=tol, name="y")
    assert_rel_close(list(g), list(ref_g), dtype, tol=tol, name="grads")


def test_plans_follow_shape_stride_dtype_and_layout(triton_device):
    """After a warm call, calls that differ in rows, leading dimensions, the input's strides, the weights'
    strides (``param.data`` swapped for a transposed copy), the dtype (``module.to``, which swaps ``.data`` in
    place: the same Parameter objects) and which inputs need a gradient each get values and gradients of
    their own (a plan of the warm call's would read the wrong sizes or strides)."""
    torch.manual_seed(0)
    mlp = MLP([7, 33, 5], activation="sigmoid").to(triton_device)
    with apex.backend("triton"):
        x = torch.randn(6, 7, device=triton_device, requires_grad=True)
        _check_mlp(mlp, x)
        _check_mlp(mlp, x)  # warm: the plan's own launches
        _check_mlp(mlp, torch.randn(11, 7, device=triton_device, requires_grad=True))
        _check_mlp(mlp, torch.randn(2, 3, 7, device=triton_device, requires_grad=True))
        # Leading dimensions whose rows are a view at strides (1, 6), not a dense copy.
        x3 = torch.randn(7, 2, 3, device=triton_device).permute(1, 2, 0).requires_grad_()
        assert x3.reshape(-1, 7).stride() == (1, 6)
        _check_mlp(mlp, x3)
        _check_mlp(mlp, torch.randn(7, 6, device=triton_device).t().requires_grad_())  # strides (1, 6)
        _check_mlp(mlp, torch.randn(6, 7, device=triton_device))  # no input gradient
        with torch.no_grad():
            mlp.weight_1.data = mlp.weight_1.data.t().contiguous().t()  # same values, strides (1, 5)
        assert mlp.weight_1.stride() == (1, 5)
        _check_mlp(mlp, x)
        mlp.requires_grad_(False)
        _check_mlp(mlp, x)  # the input's gradient alone
        mlp.requires_grad_(True)
        mlp.to(torch.bfloat16)
        _check_mlp(mlp, x.detach().bfloat16().requires_grad_(), torch.bfloat16)


def test_backward_plans_follow_which_inputs_need_a_gradient(triton_device):
    """One forward plan, backwards for every pattern of gradients needed, in an order where each pattern's
    launches differ from the previous one's (the weights' alone, then the input's alone, then all)."""
    torch.manual_seed(0)
    mlp = MLP([7, 9, 3], activation="relu").to(triton_device)
    x = torch.randn(5, 7, device=triton_device)
    with apex.backend("triton"):
        for x_grad, w_grad in [(False, True)] * 2 + [(True, False), (True, True), (False, True), (True, False)]:
            mlp.requires_grad_(w_grad)
            _check_mlp(mlp, x.clone().requires_grad_(x_grad))
    mlp.requires_grad_(True)


def test_backward_reads_the_saved_strides(triton_device):
    """A weight whose ``.data`` is swapped between the forward and the backward (no version bump: FSDP-style
    code does it) is read at its strides then, as the general path reads it: the backward's plan is keyed on
    the saved tensors' strides too."""
    torch.manual_seed(0)
    dense = FusedDense(9, 5).to(triton_device)
    x = torch.randn(4, 9, device=triton_device, requires_grad=True)
    dy = torch.randn(4, 5, device=triton_device)
    w64 = dense.weight.detach().double()
    ref = [dy.double() @ w64, dy.double().t() @ x.detach().double(), dy.double().sum(0)]
    contiguous = dense.weight.data
    transposed = contiguous.t().contiguous().t()  # the same values at strides (1, 5)
    with apex.backend("triton"):
        # Warm calls at each layout (their plans' backwards cached), then a forward at one layout and a
        # backward at the other, both ways.
        for before, after in [(contiguous, contiguous)] * 2 + [(transposed, transposed)] * 2 + [
                (contiguous, transposed), (transposed, contiguous)]:
            dense.weight.data = before
            y = dense(x)
            dense.weight.data = after
            grads = torch.autograd.grad(y, [x, dense.weight, dense.bias], dy)
            assert_rel_close(list(grads), ref, tol=1e-5)


@pytest.mark.parametrize("layout", ["clone", "transposed"])
def test_saved_tensor_hooks(triton_device, layout):
    """Saved-tensor hooks (offloading, compression) may give the saved tensors back as copies, in another layout
    (``transposed``: column-major copies of every 2-D one): the backward reads them as given."""
    torch.manual_seed(0)

    def unpack(t):
        return t.t().contiguous().t() if layout == "transposed" and t.dim() == 2 else t.clone()

    mlp = MLP([7, 33, 5], activation="relu").to(triton_device)
    x = torch.randn(6, 7, device=triton_device, requires_grad=True)
    with apex.backend("triton"):
        for _ in range(2):  # the second call takes the warm plan
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                _check_mlp(mlp, x)


def test_bad_calls_after_a_warm_call_are_checked(triton_device):
    """A plan stands for checks passed: a call whose facts differ from the warm call's (a weight of another
    dtype, a bias on another device, an input of another width) misses it and fails as before, leaving the
    warm call's plan and values as they were."""
    dense = FusedDense(5, 3).to(triton_device)
    x = torch.randn(4, 5, device=triton_device, requires_grad=True)
    with apex.backend("triton"):
        dense(x)
        ref = dense(x)
        with pytest.raises(ValueError, match="weight 0 expects 5 input features"):
            dense(torch.randn(4, 6, device=triton_device))
        with pytest.raises(TypeError, match="input must be a floating"):
            dense(torch.ones(4, 5, dtype=torch.int32, device=triton_device))
        bias = dense.bias
        with torch.no_grad():
            dense.bias = torch.nn.Parameter(bias.to("meta"))
        with pytest.raises(ValueError, match="bias 0 is on meta"):
            dense(x)
        dense.bias = bias
        with pytest.raises(TypeError, match="weight 0 has dtype"):
            dense(x.detach().half())
        # The input as the warm call's, one parameter changed in place (``.data``: the same Parameter object).
        for name, change, err, match in [("weight", lambda t: t.half(), TypeError, "weight 0 has dtype"),
                                         ("bias", lambda t: t.double(), TypeError, "bias 0 has dtype"),
                                         ("bias", lambda t: t[:2], ValueError, "bias 0 must have shape")]:
            p = getattr(dense, name)
            data = p.data
            p.data = change(data)
            try:
                with pytest.raises(err, match=match):
                    dense(x)
            finally:
                p.data = data
        weight = dense.weight
        dense.weight = torch.nn.Parameter(weight.detach().to("meta"))
        with pytest.raises(ValueError, match="weight 0 is on meta"):
            dense(x)
        dense.weight = weight
        assert torch.equal(dense(x), ref)


@pytest.mark.parametrize("case", ["mlp_relu", "mlp_none_nobias", "mlp3_sigmoid", "dense", "dense_3d",
                                  "gelu_dense", "weights_only", "input_only"])
def test_plan_launches_equal_the_general_path(triton_device, case):
    """The plan's launches (the public entries' eager path) give the general path's results bit for bit: the
    same kernels with the same arguments (``MlpFunction.apply`` and the other Functions take the general
    code). Outputs and every gradient, with and without a graph."""
    torch.manual_seed(0)
    dev = triton_device
    if case.startswith("mlp"):
        sizes, bias, act = {"mlp_relu": ([7, 33, 5], True, "relu"), "mlp_none_nobias": ([7, 33, 5], False, "none"),
                            "mlp3_sigmoid": ([7, 9, 5, 3], True, "sigmoid")}[case]
        module = MLP(sizes, bias=bias, activation=act).to(dev)
        code = module.activation

        def general(x, *p):
            return MlpFunction.apply(module.bias, code, x, *module.weights, *module.biases)
    elif case == "gelu_dense":
        module = FusedDenseGeluDense(7, 33, 5).to(dev)

        def general(x, *p):
            return FusedDenseGeluDenseFunc.apply(x, *p)
    else:
        module = FusedDense(7, 5).to(dev)

        def general(x, *p):
            return FusedDenseFunc.apply(x, *p)
    x = torch.randn(2, 3, 7, device=dev) if case == "dense_3d" else torch.randn(6, 7, device=dev)
    x.requires_grad_(case != "weights_only")
    module.requires_grad_(case != "input_only")
    params = list(module.parameters())
    leaves = [t for t in (x, *params) if t.requires_grad]
    with apex.backend("triton"):
        module(x)  # the first call loads the kernels; the next ones take the plan
        y = module(x)
        y_ref = general(x, *params)
        assert type(y.grad_fn).__name__ == "_DirectChainBackward"
        assert type(y_ref.grad_fn).__name__ != "_DirectChainBackward"
        dy = torch.randn_like(y)
        g, g_ref = torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, leaves, dy)
        with torch.no_grad():
            y_plain = module(x)
    assert torch.equal(y, y_ref) and torch.equal(y_plain, y_ref)
    assert all(torch.equal(a, b) for a, b in zip(g, g_ref))


def test_torch_path_then_triton_path(triton_device):
    """A chain first checked on the PyTorch path (kept as checked, not planned) is planned when the Triton path
    is chosen later, and a plan made on the Triton path is not used on the PyTorch path."""
    if triton_device.type != "cpu":
        pytest.skip("the PyTorch path of CPU tensors")
    mlp = MLP([7, 9, 3])
    x = torch.randn(5, 7, requires_grad=True)
    for name in ("triton", "torch", "torch", "triton", "triton", "torch"):
        with apex.backend(name):
            _check_mlp(mlp, x)


def test_tuning_invalidate_forgets_the_plans(triton_device):
    """The chain plans hold the GEMM plans' launch configurations: :func:`apex._kernels._tuning.invalidate`
    empties both, and the next call plans again."""
    from apex._kernels import _tuning

    C = _chains()
    mlp = MLP([7, 9, 3]).to(triton_device)
    x = torch.randn(5, 7, device=triton_device, requires_grad=True)
    with apex.backend("triton"):
        _check_mlp(mlp, x)
        _check_mlp(mlp, x)
        assert any(isinstance(p, C.ChainPlan) for p in C.CHAINS.values())
        _tuning.invalidate()
        assert not C.CHAINS
        _check_mlp(mlp, x)


class _Recorder:
    """Stands in for the GEMM kernel: records each launch's ``PRECISION`` constexpr (the 24th argument)."""

    def __init__(self):
        self.precisions = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

    def run(self, *args, grid, warmup, **kwargs):
        self.precisions.append(args[23])


@pytest.mark.no_triton_launch("a recording stand-in replaces the GEMM kernel")
def test_tf32_flag_is_read_at_every_call(monkeypatch, triton_device):
    """On a GPU the plan's fp32 launches take tf32 exactly where ``torch.backends.cuda.matmul.allow_tf32``
    allows it at that call, forward and backward (the flag is not part of the key: the plan holds both
    constexpr tails). Seen on CPU tensors with GPU launch configurations and a recording kernel."""
    K = _kernels()
    rec = _Recorder()
    monkeypatch.setattr(K, "_INTERP", False)
    monkeypatch.setattr(K, "_config", lambda m, n, k, dt, hip=None: dict(BM=16, BN=16, BK=16, GROUP_M=8, num_warps=4,
                                                                         num_stages=None))
    monkeypatch.setattr(K, "_gemm_kernel", rec)
    monkeypatch.setattr(K, "_PLANS", {})
    monkeypatch.setattr(_chains(), "CHAINS", {})
    dense = FusedDense(7, 5).to(triton_device)
    x = torch.randn(4, 7, device=triton_device, requires_grad=True)
    flag = torch.backends.cuda.matmul.allow_tf32
    seen = {}
    try:
        with apex.backend("triton"):
            for allow in (False, True, False, True):
                torch.backends.cuda.matmul.allow_tf32 = allow
                rec.precisions.clear()
                y = dense(x)
                torch.autograd.grad(y, [x, dense.weight, dense.bias], torch.ones_like(y))
                seen.setdefault(allow, []).append(list(rec.precisions))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag
    # (three launches a call: the forward's GEMM, the weight and the input gradients')
    assert seen[False] == [["ieee"] * 3] * 2 and seen[True] == [["tf32"] * 3] * 2, seen


def test_modes_and_subclasses_take_the_general_path(triton_device):
    """A dispatch mode or a tensor subclass sees what it saw before: the chain's own Function, not the plan."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    dense = FusedDense(7, 5).to(triton_device)
    x = torch.randn(4, 7, device=triton_device, requires_grad=True)
    with apex.backend("triton"):
        ref = dense(x)
        ref = dense(x)
        with Seen() as mode:
            y = dense(x)
        assert type(y.grad_fn).__name__ == "FusedDenseFuncBackward" and "aten.new_empty.default" in mode.ops
        assert torch.equal(y, ref)
        ys = dense(x.detach().as_subclass(Sub).requires_grad_())
        assert type(ys.grad_fn).__name__ == "FusedDenseFuncBackward"
        assert torch.equal(ys.as_subclass(torch.Tensor), ref)
