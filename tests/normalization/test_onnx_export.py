"""torch.onnx.export (torch 2.13's default, torch.export-based exporter) of models built on apex.normalization:
while exporting, the norms record standard operators instead of apex's custom ops, on either backend, and the
ONNX graph computes the module's values (run with onnx's reference evaluator)."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from apex.normalization import FusedLayerNorm, FusedRMSNorm, MixedFusedRMSNorm, fused_rms_norm_affine
from apex.testing import assert_rel_close

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
from onnx.reference import ReferenceEvaluator  # noqa: E402


class _RMSFunctional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.25 * torch.randn(16))

    def forward(self, x):
        return fused_rms_norm_affine(x, self.weight, [16], 1e-5)


def _export(module, x) -> onnx.ModelProto:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), f, input_names=["x_in"], opset_version=18, verbose=False)
    return onnx.load_from_string(f.getvalue())


def _randomize(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(1 + 0.25 * torch.randn_like(p))
    return module


CASES = {
    "rms": lambda: _randomize(FusedRMSNorm([32, 16])),
    "rms-no-affine": lambda: FusedRMSNorm(16, elementwise_affine=False),
    "rms-memory-efficient": lambda: _randomize(FusedRMSNorm(16, memory_efficient=True)),
    "mixed-rms": lambda: _randomize(MixedFusedRMSNorm([32, 16])),
    "rms-functional": _RMSFunctional,
    "layer": lambda: _randomize(FusedLayerNorm([32, 16])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_onnx_export_records_standard_ops_with_the_modules_values(name, backend_name):
    """``triton``: the custom-op path a GPU takes outside export (on the GPU under APEX_TEST_DEVICE=cuda),
    whose values the exported graph must reproduce."""
    if backend_name == "triton" and name not in ("rms", "layer"):
        pytest.skip("the GPU path is checked on one RMSNorm and one LayerNorm")
    torch.manual_seed(0)
    module = CASES[name]()
    x = torch.randn(4, 32, 16) * 3 + 1
    model = _export(module, x)
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert not any("apex" in d or "apex" in t for d, t in ops), ops
    assert {"ReduceMean", "LayerNormalization"} & {t for _, t in ops}, ops
    assert model.graph.input[0].name == "x_in"
    (y,) = ReferenceEvaluator(model).run(None, {"x_in": x.cpu().numpy()})
    with torch.no_grad():
        assert_rel_close(torch.from_numpy(y).to(x.device), module(x), tol=1e-5)


def test_export_keeps_half_precision_policy():
    """fp16 input, fp32 statistics, one rounding: the exported graph's output dtype is the module's."""
    module = _randomize(FusedRMSNorm(16)).half()
    x = torch.randn(8, 16, dtype=torch.float16)
    ep = torch.export.export(module, (x,))
    assert not any("apex" in str(n.target) for n in ep.graph.nodes)
    y = ep.module()(x)
    assert y.dtype == torch.float16
    assert torch.equal(y, module(x))
