"""Sigmoid focal loss (``apex.ops.focal_loss``): forward + backward.

CPU time at (32768 anchors × 96 classes, 91 real) fp32 against the plain PyTorch composition (torchvision's
``sigmoid_focal_loss`` with Apex's masks), forward and backward together. Triton bytes and launches under
the interpreter at (256 × 96): the forward reads the logits and labels once and writes the un-normalised
gradient (one partial loss per program); the backward scales that gradient in place. Minimum: logits,
labels and gradient once forward; the gradient read and written once backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._harness import Case, Counted

ALPHA, GAMMA, K_REAL = 0.25, 2.0, 91


def _inputs(m, k, grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g) * 2
    y = torch.randint(-2, K_REAL, (m,), generator=g)
    npos = torch.tensor([float(max(1, int((y >= 0).sum())))])
    if grad:
        x.requires_grad_()
    return x, y, npos


def _theirs(x, y, npos):
    k = x.shape[-1]
    t = F.one_hot(y.clamp(min=0), k).to(x.dtype) * (y >= 0).unsqueeze(-1)
    p = torch.sigmoid(x)
    ce = F.binary_cross_entropy_with_logits(x, t, reduction="none")
    loss = ce * ((1 - p) * t + p * (1 - t)) ** GAMMA * (ALPHA * t + (1 - ALPHA) * (1 - t))
    valid = (y != -2).unsqueeze(-1) & (torch.arange(k) < K_REAL)
    return torch.where(valid, loss, 0).sum() / npos.reshape(())


def _ours(x, y, npos):
    from apex.ops.focal_loss import focal_loss

    return focal_loss(x, y, npos, K_REAL, ALPHA, GAMMA, 0.0)


def _timed(m, k):
    x, y, npos = _inputs(m, k, grad=True)
    return (lambda: torch.autograd.grad(_ours(x, y, npos), x)), (lambda: torch.autograd.grad(_theirs(x, y, npos), x))


def _counted(m, k):
    x, y, npos = _inputs(m, k, grad=True)
    return Counted(triton=lambda: torch.autograd.grad(_ours(x, y, npos), x),
                   eager=lambda: torch.autograd.grad(_theirs(x, y, npos), x),
                   bytes_min=x.nbytes + y.nbytes + x.nbytes + 2 * x.nbytes,
                   note="forward + backward; eager = plain PyTorch focal loss and its autograd backward")


def cases() -> list[Case]:
    return [Case("focal_loss_fwd_bwd_32768x96", timed=lambda: _timed(32768, 96), counted=lambda: _counted(256, 96),
                 torch_label="PyTorch focal loss (fwd+bwd)")]
