"""torch.amp.GradScaler with bf16 gradients on the Triton path (GPUs).

PyTorch's CUDA ``_amp_foreach_non_finite_check_and_unscale_`` has no bf16 kernel, so a GradScaler step of
a bf16 model fails there if the optimizer leaves the check to PyTorch. Apex's optimizers take
``step(grad_scaler=...)`` and check the gradients with apex's own multi-tensor kernel where the Triton path
runs. On a CPU the same path runs under the interpreter, with PyTorch's op made to refuse bf16 as the CUDA
one does: the steps must neither call it with bf16 gradients nor differ from an unscaled step.
"""

import copy

import pytest
import torch

from apex.optimizers import FusedAdagrad, FusedAdam, FusedLARS, FusedMixedPrecisionLamb, FusedSGD
from tests.optimizers._common import assert_state_equal, clone_params, grads_for_step, make_params

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

    params = make_params([(33,), (4097,), (3, 5)], torch.bfloat16)
    opt = OPTIMIZERS[name](params)
    scaler = torch.amp.GradScaler(triton_device.type, init_scale=2.0 ** 8)
    scaler.scale(torch.ones((), device=triton_device))  # initialises the scale, as scaling a loss does
    with apex.backend("triton"):
        for s in range(2):
            for p, g in zip(params, grads_for_step(params, s, scale=2.0 ** 8)):
                p.grad = g
            scaler.step(opt)
            scaler.update()
        before = [p.detach().clone() for p in params]
        state = copy.deepcopy(opt.state_dict())
        scale = scaler.get_scale()
        for p, g in zip(params, grads_for_step(params, 5, scale=scale)):
            p.grad = g
        params[2].grad[1, 1] = float("inf")
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() < scale  # the scaler saw the inf (found_inf recorded for update())
        assert all(torch.equal(a, b) for a, b in zip(params, before))
        assert_state_equal(opt.state_dict(), state)
        # The next finite step equals an unscaled step of a twin optimizer.
        twins = clone_params(params)
        ref = OPTIMIZERS[name](twins)
        ref.load_state_dict(copy.deepcopy(opt.state_dict()))
        scale = scaler.get_scale()
        g = grads_for_step(params, 6)
        for p, t, gg in zip(params, twins, g):
            p.grad = (gg.float() * scale).to(p.dtype)
            t.grad = gg.clone()
        scaler.step(opt)
        scaler.update()
        ref.step()
    assert cuda_like_unscale == []
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
