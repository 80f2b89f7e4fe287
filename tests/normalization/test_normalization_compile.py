"""torch.compile(fullgraph=True) traces models built on apex.normalization without graph breaks."""

from __future__ import annotations

import pytest
import torch

from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm, MixedFusedRMSNorm, fused_rms_norm
from apex.testing import assert_rel_close


class _TwoLayer(torch.nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.fc1 = torch.nn.Linear(d, d)
        self.norm1 = FusedLayerNorm(d)
        self.fc2 = torch.nn.Linear(d, d)
        # memory_efficient goes through the apex::rms_norm custom op, fake and autograd registrations.
        self.norm2 = FusedRMSNorm(d, memory_efficient=True)

    def forward(self, x):
        return self.norm2(self.fc2(torch.relu(self.norm1(self.fc1(x)))))


def _assert_matches_eager(compiled, eager, x, params):
    """The compiled function's output and gradients (of ``x`` and ``params``) match eager's to 1e-5."""
    leaves = [x, *params]
    y = compiled(x)
    grads = torch.autograd.grad(y.square().sum(), leaves)
    y_ref = eager(x)
    ref = torch.autograd.grad(y_ref.square().sum(), leaves)
    assert_rel_close(y, y_ref, tol=1e-5)
    assert_rel_close(list(grads), list(ref), tol=1e-5)


def test_compiled_two_layer_model_matches_eager():
    torch._dynamo.reset()
    model = _TwoLayer()
    with torch.no_grad():
        model.norm1.weight.copy_(1 + 0.25 * torch.randn(32))
        model.norm2.weight.copy_(1 + 0.25 * torch.randn(32))
    x = torch.randn(8, 32, requires_grad=True)
    _assert_matches_eager(torch.compile(model, fullgraph=True), model, x, model.parameters())


def test_triton_path_traces_as_custom_ops(triton_device):
    """With the Triton backend the norms are apex:: custom ops in the graph (fake + autograd kernels);
    aot_eager runs them (interpreted here) without Inductor's compile time."""
    import apex
    from apex.normalization import fused_add_rms_norm

    torch._dynamo.reset()
    model = _TwoLayer(16)
    model.norm2.memory_efficient = False
    x = torch.randn(4, 16, requires_grad=True)

    def step(x):
        y = model(x)
        out, h = fused_add_rms_norm(y, x, model.norm2.weight, (16,))
        return out + h

    with apex.backend("triton"):
        _assert_matches_eager(torch.compile(step, fullgraph=True, backend="aot_eager"), step, x,
                              model.parameters())


@pytest.mark.parametrize("make", [lambda: FusedLayerNorm([4, 6]), lambda: FusedLayerNorm(6, elementwise_affine=False),
                                  lambda: MixedFusedLayerNorm(6), lambda: FusedRMSNorm([4, 6]),
                                  lambda: MixedFusedRMSNorm(6)],
                         ids=["layer", "layer-no-affine", "mixed-layer", "rms", "mixed-rms"])
def test_jit_trace_records_pytorch_ops(make):
    """As in Apex, a traced module (TorchScript, ONNX export) falls back to PyTorch's own operators, which
    exporters know; the values are the module's."""
    module = make()
    x = torch.randn(3, 4, 6)
    traced = torch.jit.trace(module, (x,))
    kinds = {node.kind() for node in traced.graph.nodes()}
    assert not any(k.startswith("apex::") for k in kinds), kinds
    assert "aten::layer_norm" in kinds or "aten::rsqrt" in kinds
    torch.testing.assert_close(traced(x), module(x))


@pytest.mark.parametrize("make", [lambda: FusedLayerNorm([4, 6]), lambda: MixedFusedLayerNorm(6)],
                         ids=["layer", "mixed-layer"])
def test_jit_script_of_layer_norm_modules(make):
    module = make()
    scripted = torch.jit.script(module)
    x = torch.randn(3, 4, 6)
    torch.testing.assert_close(scripted(x), module(x))


def test_float64_inputs_are_not_cast_by_autocast():
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fused_rms_norm(x, [8]).dtype == torch.float64
        assert FusedLayerNorm(8).double()(x).dtype == torch.float64
        assert FusedLayerNorm(8)(x.float()).dtype == torch.bfloat16
