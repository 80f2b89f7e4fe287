"""vocab_parallel_cross_entropy on 2 and 4 Gloo ranks equals F.cross_entropy on the gathered logits
(loss and gradient, with and without label smoothing); bad targets raise; the logits are not modified."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from apex.testing import rel_error
from apex.transformer import parallel_state as ps
from apex.transformer.tensor_parallel import vocab_parallel_cross_entropy
from tests.transformer import _dist


def check_cross_entropy_matches_torch(rank, world):
    for tp in (1, 2, 4):
        if world % tp:
            continue
        ps.initialize_model_parallel(tp)
        r = ps.get_tensor_model_parallel_rank()
        vocab = 11 * tp
        for alpha in (0.0, 0.1):
            torch.manual_seed(3)
            logits = torch.randn(13, 5, vocab) * 30  # large logits exercise the max subtraction
            target = torch.randint(0, vocab, (13, 5))
            upstream = torch.randn(13, 5)
            part = logits.chunk(tp, -1)[r].clone().requires_grad_()
            before = part.detach().clone()
            loss = vocab_parallel_cross_entropy(part, target, label_smoothing=alpha)
            torch.testing.assert_close(part.detach(), before, rtol=0, atol=0)
            (loss * upstream).sum().backward()
            full = logits.double().requires_grad_()
            # NeMo/upstream convention: the mass alpha goes to the V-1 other classes
            smoothing = alpha * vocab / (vocab - 1)
            ref = F.cross_entropy(full.view(-1, vocab), target.view(-1), reduction="none",
                                  label_smoothing=smoothing).view_as(target)
            (ref * upstream.double()).sum().backward()
            assert rel_error(loss, ref) <= 1e-6, (tp, alpha, rel_error(loss, ref))
            assert rel_error(part.grad, full.grad.chunk(tp, -1)[r]) <= 1e-6, (tp, alpha)
        with pytest.raises(ValueError, match=rf"target ids must be in \[0, {vocab}\)"):
            vocab_parallel_cross_entropy(torch.zeros(2, 11), torch.tensor([0, vocab]))
        with pytest.raises(ValueError, match="label_smoothing"):
            vocab_parallel_cross_entropy(torch.zeros(2, 11), torch.tensor([0, 1]), label_smoothing=1.0)
        ps.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", _dist.checks_of(sys.modules[__name__]))
def test_distributed(check, world_size, dist_device):
    _dist.assert_check(__name__, check, world_size, dist_device)
