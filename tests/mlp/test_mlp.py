"""apex.mlp.MLP against nn.Sequential in float64, both backends; construction, autocast and errors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from apex.mlp import MLP, MlpFunction, mlp_function
from apex.testing import assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACTS = {"none": None, "relu": nn.ReLU, "sigmoid": nn.Sigmoid}


def _sequential(mlp, activation, dtype=torch.float64):
    layers = []
    for i in range(mlp.num_layers):
        lin = nn.Linear(mlp.mlp_sizes[i], mlp.mlp_sizes[i + 1], bias=bool(mlp.bias)).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(mlp.weights[i])
            if mlp.bias:
                lin.bias.copy_(mlp.biases[i])
        layers.append(lin)
        if ACTS[activation] is not None:
            layers.append(ACTS[activation]())
    return nn.Sequential(*layers)


def _run(module, x, dy):
    params = [x] + list(module.parameters())
    y = module(x)
    return y, torch.autograd.grad(y, params, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", list(ACTS))
@pytest.mark.parametrize("sizes", [[7, 129, 1], [1000, 7, 33], [1, 129, 7, 5]], ids=str)
def test_matches_sequential(backend_name, sizes, activation, bias, dtype):
    mlp = MLP(sizes, bias=bias, activation=activation).to(dtype)
    x = torch.randn(9, sizes[0]).to(dtype).requires_grad_()
    dy = torch.randn(9, sizes[-1]).to(dtype)
    y, g = _run(mlp, x, dy)
    x64 = x.detach().double().requires_grad_()
    ref_y, ref_g = _run(_sequential(mlp, activation), x64, dy.double())
    base_y, base_g = _run(_sequential(mlp, activation, dtype), x, dy)
    tol = 1e-5 if dtype == torch.float32 else None
    assert y.dtype == dtype
    assert_rel_close(y, ref_y, dtype, tol=tol, baseline=base_y, name="y")
    # Parameters are registered as nn.Sequential's are: weight_i, bias_i per layer.
    assert_rel_close(list(g), list(ref_g), dtype, tol=tol, baseline=list(base_g), name="grads")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_autocast(backend_name, device, dtype):
    mlp = MLP([7, 33, 5], activation="relu")
    x = torch.randn(6, 7, requires_grad=True)
    # Autocast of the device the case runs on: the GPU's under APEX_TEST_DEVICE=cuda.
    with torch.autocast(device.type, dtype=dtype):
        y = mlp(x)
        base = _sequential(mlp, "relu", torch.float32)(x)
    assert y.dtype == dtype and base.dtype == dtype
    y.float().sum().backward()
    assert mlp.weight_0.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    ref = _sequential(mlp, "relu")(x.detach().double())
    assert_rel_close(y, ref, dtype, baseline=base)


def test_construction_and_layout():
    mlp = MLP([480, 1024, 1])
    assert mlp.num_layers == 2 and mlp.bias == 1 and mlp.activation == 1
    assert [n for n, _ in mlp.named_parameters()] == ["weight_0", "bias_0", "weight_1", "bias_1"]
    assert mlp.weights[0].shape == (1024, 480) and mlp.biases[1].shape == (1,)
    assert mlp.weights[0] is mlp.weight_0
    # Apex's initialisation: N(0, 2/(fan_in+fan_out)) for weights, N(0, 1/fan_out) for biases.
    assert abs(mlp.weight_0.std().item() - math.sqrt(2 / 1504)) < 0.05 * math.sqrt(2 / 1504)
    assert abs(mlp.bias_0.std().item() - math.sqrt(1 / 1024)) < 0.1 * math.sqrt(1 / 1024)
    assert repr(mlp).startswith("MLP(MLP sizes: [480, 1024, 1], Bias=1, activation=1")
    nb = MLP([3, 4], bias=False, activation="none")
    assert nb.biases == [] and [n for n, _ in nb.named_parameters()] == ["weight_0"] and nb.activation == 0
    half = MLP([3, 4, 2]).half()
    assert half.weights[1].dtype == torch.float16  # the lists follow dtype conversions
    assert MLP([3, 4], activation="sigmoid").activation == 2


def test_leading_dims_and_function_signatures():
    mlp = MLP([5, 6, 3])
    x = torch.randn(2, 4, 5)
    y = mlp(x)
    assert y.shape == (2, 4, 3)
    assert torch.allclose(y.reshape(8, 3), mlp(x.reshape(8, 5)))
    assert torch.allclose(MlpFunction.apply(1, 1, x.reshape(8, 5), *mlp.weights, *mlp.biases), y.reshape(8, 3))
    assert torch.allclose(mlp_function(1, 1, x, *mlp.weights, *mlp.biases), y)


def test_no_input_grad_gives_weight_grads(backend_name):
    mlp = MLP([7, 9, 3])
    x = torch.randn(4, 7)
    mlp(x).sum().backward()
    ref = _sequential(mlp, "relu")
    ref(x.double()).sum().backward()
    assert_rel_close(mlp.weight_0.grad, ref[0].weight.grad, tol=1e-5)
    assert_rel_close(mlp.bias_1.grad, ref[2].bias.grad, tol=1e-5)


def test_errors():
    with pytest.raises(TypeError, match="activation"):
        MLP([3, 4], activation="gelu")
    for bad in ([3], [3, 0], "34", [3, 4.0]):
        with pytest.raises(ValueError, match="mlp_sizes"):
            MLP(bad)
    mlp = MLP([5, 4])
    with pytest.raises(ValueError, match="weight 0 expects 5 input features"):
        mlp(torch.randn(2, 6))
    with pytest.raises(TypeError, match="input must be a floating"):
        mlp(torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(TypeError, match="weight 0 has dtype"):
        mlp(torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="activation"):
        mlp_function(1, 4, torch.randn(2, 5), *mlp.weights, *mlp.biases)
    with pytest.raises(ValueError, match="biases"):
        mlp_function(1, 1, torch.randn(2, 5), *mlp.weights)


@pytest.mark.parametrize("layer", [0, 1])
def test_bias_on_another_device_is_refused(backend_name, device, layer):
    """A bias on another device than the input is refused with an error naming it, before any kernel reads it
    (a kernel would take its address for a device one); ``meta`` stands in for another device."""
    mlp = MLP([5, 4, 3]).to(device)
    x = torch.randn(2, 5, device=device)
    biases = [b.detach() for b in mlp.biases]
    biases[layer] = biases[layer].to("meta")
    before = x.clone()
    with pytest.raises(ValueError, match=f"bias {layer} is on meta"):
        mlp_function(1, 1, x, *mlp.weights, *biases)
    assert torch.equal(x, before)


@pytest.mark.slow
def test_compiled_fullgraph_matches_eager():
    """torch.compile(fullgraph=True) traces MLP and FusedDenseGeluDense (PyTorch path on CPU) with no break."""
    from apex.fused_dense import FusedDenseGeluDense

    torch._dynamo.reset()
    model = nn.Sequential(MLP([7, 9, 5], activation="sigmoid"), FusedDenseGeluDense(5, 11, 3))
    x = torch.randn(4, 7, requires_grad=True)
    compiled = torch.compile(model, fullgraph=True)
    leaves = [x, *model.parameters()]
    y = compiled(x)
    g = torch.autograd.grad(y.square().sum(), leaves)
    y_ref = model(x)
    ref = torch.autograd.grad(y_ref.square().sum(), leaves)
    assert_rel_close(y, y_ref, tol=1e-5)
    assert_rel_close(list(g), list(ref), tol=1e-5)


def _graphs_of_compiled_steps(kind: str, steps: int = 3) -> list:
    """The graphs torch.compile makes over ``steps`` compiled forward + backward steps of a fresh ``kind``."""
    from apex.fused_dense import FusedDense, FusedDenseGeluDense

    model = {"MLP": lambda: MLP([8, 6, 4]), "FusedDense": lambda: FusedDense(8, 4),
             "FusedDenseGeluDense": lambda: FusedDenseGeluDense(8, 6, 4)}[kind]()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=count)
        x = torch.randn(3, 8, requires_grad=True)
        for _ in range(steps):
            compiled(x).square().sum().backward()
    finally:
        torch._dynamo.reset()
    return graphs


@pytest.mark.parametrize("kind", ["MLP", "FusedDense", "FusedDenseGeluDense"])
def test_compiled_training_steps_trace_one_graph(backend_name, kind):
    """Steps of a compiled forward + backward reuse one graph: nothing the traced call reads (the checked
    activation codes, the layout caches) changes at the next eager call, and no torch.compile warning about
    cache wrappers."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graphs = _graphs_of_compiled_steps(kind)
    assert len(graphs) == 1
    assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message) for w in caught]


class _TorchGemm:
    """Stands in for ``apex._kernels.fused_dense._gemm_kernel``: ``kernel[grid](...)`` computes the launch's
    ``C = A @ B`` (no prologue or epilogue: the values do not matter here) with PyTorch ops, which Dynamo
    traces on the CPU, where it would trace into the Triton interpreter."""

    def __getitem__(self, grid):
        return self.launch

    @staticmethod
    def launch(A, B, C, Bias, AuxA, AuxC, DB, M, N, K, s_am, s_ak, s_bk, s_bn, *constexprs, **options):
        C.copy_(torch.as_strided(A, (M, K), (s_am, s_ak)) @ torch.as_strided(B, (K, N), (s_bk, s_bn)))
        if constexprs[7]:  # ROWSUM: the bias gradient
            DB.zero_()


@pytest.mark.parametrize("kind", ["MLP", "FusedDense", "FusedDenseGeluDense"])
def test_compiled_training_steps_on_the_triton_path_trace_one_graph(monkeypatch, kind):
    """The Triton path under torch.compile (where GPU tensors go; forced here, its GEMM kernel replaced by
    PyTorch ops) traces one graph for all steps, and reads and fills no module-level plan cache: a graph that
    read ``apex._kernels.fused_dense._PLANS`` guarded on it, and the plans its first tracing put there failed
    that guard at the next step (8 graphs for 3 steps of MLP on a GPU, where no earlier call had planned its
    shapes). The CPU's own compiled steps (the PyTorch path) never trace that code."""
    pytest.importorskip("triton")
    import apex.ops.fused_dense as ops
    from apex._kernels import fused_dense as K

    monkeypatch.setattr(ops, "_use_triton", lambda x, *_, compiling=None: True)
    monkeypatch.setattr(K, "_gemm_kernel", _TorchGemm())
    plans = dict(K._PLANS)
    graphs = _graphs_of_compiled_steps(kind)
    assert len(graphs) == 1
    assert K._PLANS.keys() == plans.keys() and all(K._PLANS[key] is plan for key, plan in plans.items())


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def test_parametrized_parameters(backend_name):
    """A parametrization (``torch.nn.utils.parametrize``) puts a property where a registered parameter was:
    the MLP reads registered parameters straight from ``_parameters``, and a parametrized one through the
    property: its value in the forward, its gradient to the original."""
    from torch.nn.utils import parametrize

    mlp = MLP([5, 7, 3], activation="none")
    parametrize.register_parametrization(mlp, "weight_1", _Doubled())
    x = torch.randn(4, 5, requires_grad=True)
    w1 = mlp.parametrizations.weight_1.original
    y = mlp(x)
    (gw1,) = torch.autograd.grad(y.sum(), w1)
    x64, w164 = x.detach().double(), w1.detach().double().requires_grad_()
    h = nn.functional.linear(x64, mlp.weight_0.detach().double(), mlp.bias_0.detach().double())
    ref = nn.functional.linear(h, 2 * w164, mlp.bias_1.detach().double())
    assert_rel_close(y, ref, torch.float32)
    assert_rel_close(gw1, torch.autograd.grad(ref.sum(), w164)[0], torch.float32, name="weight grad")
