"""apex.contrib.xentropy: Apex's module API and the ``xentropy_cuda`` compatibility module."""

import pytest
import torch

from apex.testing import assert_rel_close


def _label_smoothing_raw(x, target, padding_idx, smoothing):
    """Apex's own test reference (its ``label_smoothing_raw``), in float64."""
    logprobs = torch.nn.functional.log_softmax(x.double(), dim=-1)
    non_pad = target != padding_idx
    nll = -logprobs.gather(dim=-1, index=target.unsqueeze(1)).squeeze(1)
    smooth = -logprobs.mean(dim=-1)
    return torch.where(non_pad, (1.0 - smoothing) * nll + smoothing * smooth, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_softmax_cross_entropy_loss_apply(backend_name, dtype):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    n, v, smoothing, pad = 24, 1031, 0.1, 0
    logits = torch.randn(n, v).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,))
    labels[::5] = pad
    losses = SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing, pad, dtype == torch.float16)
    losses.sum().backward()
    x64 = logits.detach().double().requires_grad_()
    ref = _label_smoothing_raw(x64, labels, pad, smoothing)
    ref.sum().backward()
    assert losses.dtype == torch.float32 and logits.grad.dtype == dtype
    assert_rel_close(losses, ref, tol=1e-5)
    assert_rel_close(logits.grad, x64.grad, dtype, tol=1e-5 if dtype == torch.float32 else 2 * 2 ** -8)
    assert (logits.grad[::5] == 0).all()


def test_inplace_backward_through_a_linear_layer(backend_name):
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 300)
    h = torch.randn(10, 16)
    labels = torch.randint(1, 300, (10,))
    ref_lin = torch.nn.Linear(16, 300)
    ref_lin.load_state_dict(lin.state_dict())
    SoftmaxCrossEntropyLoss.apply(lin(h), labels, 0.0, 0, False, True).sum().backward()
    torch.nn.functional.cross_entropy(ref_lin(h), labels, reduction="sum").backward()
    assert_rel_close([lin.weight.grad, lin.bias.grad], [ref_lin.weight.grad, ref_lin.bias.grad], tol=1e-5)


def test_compat_module_names():
    import xentropy_cuda

    assert sorted(xentropy_cuda.__all__) == ["backward", "forward"]
