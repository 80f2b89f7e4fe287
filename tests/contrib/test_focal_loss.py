"""apex.contrib.focal_loss: Apex's API against torchvision-style sigmoid focal loss (written out here)."""

import pytest
import torch
import torch.nn.functional as F

from apex.testing import assert_rel_close


def _sigmoid_focal_loss(x, y, alpha, gamma):
    """torchvision.ops.sigmoid_focal_loss with reduction="sum", in float64."""
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, y, reduction="none")
    loss = ce * ((1 - p) * y + p * (1 - y)) ** gamma
    return ((alpha * y + (1 - alpha) * (1 - y)) * loss).sum()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_focal_loss_matches_sigmoid_focal_loss(backend_name, dtype):
    from apex.contrib.focal_loss import focal_loss

    n, k, alpha, gamma = 12, 8, 0.24, 2.0
    x = torch.randn(n, k).to(dtype)
    classes = torch.randint(0, k, (n,))
    x64 = x.double().requires_grad_()
    expected = _sigmoid_focal_loss(x64, F.one_hot(classes, k).double(), alpha, gamma)
    expected.backward()
    xa = x.clone().requires_grad_()
    actual = focal_loss.FocalLoss.apply(xa, classes, torch.ones([]), k, alpha, gamma, 0.0)
    actual.backward()
    assert_rel_close(actual, expected.detach(), tol=1e-5)
    assert_rel_close(xa.grad, x64.grad, tol=1e-5 if dtype == torch.float32 else 2e-3)
    f = focal_loss.focal_loss(x.float(), classes, torch.ones([]), k, alpha, gamma)
    assert_rel_close(f, expected.detach(), tol=1e-5)


def test_compat_module_names():
    import focal_loss_cuda

    assert sorted(focal_loss_cuda.__all__) == ["backward", "forward"]
