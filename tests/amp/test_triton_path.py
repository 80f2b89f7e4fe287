"""amp's unscale on the Triton path: same results as the PyTorch path on the same device, O(1) launches.

Each test runs both paths inside the device switch (``triton_device``): on CPU tensors with the Triton kernels
interpreted, or on the GPU under ``APEX_TEST_DEVICE=cuda``."""

import pytest
import torch
import torch.nn.functional as F

import apex
from apex import amp
from tests.amp._models import mlp, mlp_data
from tests.conftest import HAS_TRITON

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _two_steps(backend, inject_second=False, accumulate=False):
    from apex.testing import TritonTrace

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = mlp_data()
    launches = []
    for step in range(2):
        opt.zero_grad()
        for _ in range(2 if accumulate else 1):
            loss = F.cross_entropy(model(x), y)
            # Bounds are checked in the kernels' own tests; the master grads these launches write are
            # allocated inside scale_loss, so they cannot be registered with the tracer beforehand.
            with apex.backend(backend), TritonTrace(bounds=False) as tr:
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                    if inject_second and step == 1:
                        model[0].weight.grad.view(-1)[3] = float("nan")
            launches.append(tr.launches)
        # The step's fp32 -> bf16 copy stays on PyTorch: the interpreter truncates that conversion instead
        # of rounding it (a known interpreter defect), which would make the runs diverge for no fault of ours.
        opt.step()
    amp.frontend._reset_casting()
    return [p.detach().clone() for p in amp.master_params(opt)], amp.state_dict(), launches


@pytest.mark.parametrize("inject", [False, True])
def test_o2_steps_match_torch_path(triton_device, inject):
    ref, ref_sd, _ = _two_steps("torch", inject)
    got, sd, launches = _two_steps("triton", inject)
    assert sd == ref_sd
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    # One launch per dtype group whatever the number of gradients: bf16 grads -> fp32 masters, and the
    # batch-norm fp32 grads in place.
    assert launches == [2, 2]


def test_accumulation_uses_one_axpby_launch(triton_device):
    ref, _, _ = _two_steps("torch", accumulate=True)
    got, _, launches = _two_steps("triton", accumulate=True)
    # First backward of a step: scale into fresh master grads; second: axpby onto them. One launch per
    # dtype group (bf16 model grads, fp32 batch-norm grads) each time.
    assert launches == [2, 2, 2, 2]
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
