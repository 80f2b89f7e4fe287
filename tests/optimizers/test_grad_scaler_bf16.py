"""torch.amp.GradScaler with bf16 gradients on the Triton path (GPUs).

PyTorch's CUDA ``_amp_foreach_non_finite_check_and_unscale_`` has no bf16 kernel, so a GradScaler step of
a bf16 model fails there if the optimizer leaves the check to PyTorch. Apex's optimizers take
``step(grad_scaler=...)`` and check the gradients with apex's own multi-tensor kernel where the Triton path
runs. On a CPU the same path runs under the interpreter, with PyTorch's op made to refuse bf16 as the CUDA
one does: the steps must neither call it with bf16 gradients nor differ from an unscaled step.
"""

import pytest
import torch

from apex.optimizers import FusedAdagrad, FusedAdam, FusedLARS, FusedMixedPrecisionLamb, FusedSGD
from tests.optimizers._common import check_grad_scaler_skips_then_resumes

OPTIMIZERS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, master_weights=True),
    "FusedAdam-capturable": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, master_weights=True,
                                                 capturable=True),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.01),
    "FusedLARS": lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "FusedMixedPrecisionLamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, weight_decay=0.01,
                                                                 reduced_precision_dtype=torch.bfloat16),
}


@pytest.fixture
def cuda_like_unscale(monkeypatch):
    """PyTorch's unscale refusing bf16 gradients, as its CUDA kernel does; counts the calls it refused."""
    original = torch._amp_foreach_non_finite_check_and_unscale_
    refused = []

    def unscale(grads, found_inf, inv_scale):
        if any(g.dtype == torch.bfloat16 for g in grads):
            refused.append(len(grads))
            raise RuntimeError('"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for '
                               "'BFloat16'")
        return original(grads, found_inf, inv_scale)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", unscale)
    return refused


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bf16_gradients_skip_on_inf_and_unscale_without_pytorchs_unscale(triton_device, cuda_like_unscale, name):
    import apex

    with apex.backend("triton"):
        check_grad_scaler_skips_then_resumes(OPTIMIZERS[name], triton_device)
    assert cuda_like_unscale == []
