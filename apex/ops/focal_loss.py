"""Sigmoid focal loss with Apex's target conventions (``apex.contrib.focal_loss``).

``cls_output`` ``[..., K]`` holds per-class logits, ``cls_targets_at_level`` ``[...]`` an int64 class per
row: ``0 ≤ y < num_real_classes`` a positive for class ``y``, ``−1`` background (every class negative),
``−2`` ignored (no loss, no gradient). Classes ``j ≥ num_real_classes`` are padding and ignored. With
``σ = sigmoid(p)`` and label smoothing ``ε`` (BCE targets ``1 − ε/2`` / ``ε/2``), an element's loss is
``α·(1−σ)^γ·BCE`` for the positive class and ``(1−α)·σ^γ·BCE`` otherwise; the result is
``Σ loss / num_positives_sum`` (a 0-d fp32 tensor; ``num_positives_sum`` is a one-element tensor).
A target outside ``[−2, num_real_classes)``: the PyTorch path raises ``ValueError``; the Triton path reads
nothing on the host (a read is a GPU synchronisation per call; Apex's kernel checks nothing): the loss is
NaN and that row's gradient zero.

As Apex, the forward also produces the un-normalised gradient (the expensive transcendental work is the
same), kept in the logits' dtype; the backward only scales it (in place) by ``grad / num_positives_sum``.
Dtype policy: arithmetic in fp32 (fp64 for fp64 logits on PyTorch). Paths: ``apex._kernels.focal_loss``
on CUDA/ROCm tensors (one pass each way, per-program partial sums, no atomics); PyTorch operators on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._dispatch import lazy_module
from apex.ops._norm import _same_device, select

Tensor = torch.Tensor
# The kernels' module, imported at the first call (an import statement costs ~1 µs a call).
_kernels = lazy_module("apex._kernels.focal_loss")


def _check(cls_output, targets, num_positives_sum, num_real_classes, alpha, gamma, label_smoothing) -> None:
    # What Apex's focal_loss_cuda checked (dtypes, shapes, num_real_classes, CUDA tensors) raises errors that are
    # also its RuntimeError; the ranges of the other arguments are checked here only.
    if not isinstance(cls_output, torch.Tensor) or not cls_output.is_floating_point():
        raise RuntimeTypeError("cls_output must be a floating-point torch.Tensor")
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64:
        got = targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__
        raise RuntimeTypeError(f"cls_targets_at_level must be an int64 tensor, got {got}")
    shape, tshape = cls_output.shape, targets.shape  # read once (each read builds a torch.Size)
    # [rows] targets of [rows, K] scores (the usual call) compare one size, without a torch.Size slice.
    if not (len(shape) == 2 and len(tshape) == 1 and tshape[0] == shape[0]
            or len(shape) >= 1 and tshape == shape[:-1]):
        raise RuntimeValueError(f"cls_targets_at_level must have shape {list(cls_output.shape[:-1])} (cls_output "
                                f"without the class dimension), got {list(targets.shape)}")
    if not isinstance(num_positives_sum, torch.Tensor) or num_positives_sum.numel() != 1 or \
            not num_positives_sum.is_floating_point():
        raise RuntimeValueError("num_positives_sum must be a one-element floating-point tensor")
    dev = cls_output.device  # one device object, compared with the others' (cheaper than flags and indices)
    if not targets.device == dev == num_positives_sum.device:
        name, t = ("cls_targets_at_level", targets) if targets.device != dev else ("num_positives_sum",
                                                                                  num_positives_sum)
        raise RuntimeValueError(f"{name} is on {t.device} but cls_output is on {dev}")
    k = shape[-1]
    if isinstance(num_real_classes, bool) or not isinstance(num_real_classes, int) or \
            not 0 < num_real_classes <= k:
        raise RuntimeValueError(f"num_real_classes must be an int in [1, {k}] (cls_output's last dimension), "
                                f"got {num_real_classes!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if float(gamma) < 0:
        raise ValueError(f"gamma must be non-negative, got {gamma!r}")


def _check_targets(targets: Tensor, num_real_classes: int) -> None:
    """The targets' range, on the PyTorch path only: the Triton kernel gives an out-of-range target a defined
    result instead (a NaN loss, a zero gradient for its row), without this host read (on a GPU a
    synchronisation per call; Apex's kernel checks nothing)."""
    if targets.numel():
        # Targets clamped to [-2, num_real_classes) and compared with themselves: two operators and one host
        # read (torch.equal) instead of aminmax, a stack and a transfer. The message's first bad target is looked
        # up only on failure.
        if not torch.equal(targets.clamp(-2, num_real_classes - 1), targets):
            bad = (targets < -2) | (targets >= num_real_classes)
            first = int(targets.reshape(-1)[bad.reshape(-1)][0])
            raise ValueError(f"cls_targets_at_level must be −2 (ignore), −1 (background) or a class in "
                             f"[0, {num_real_classes}), got {first}")


def _forward_torch(x, y, k_real, alpha, gamma, smoothing):
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    p = x.to(ct)
    k = x.shape[-1]
    cols = torch.arange(k, device=x.device)
    pos = (cols == y.unsqueeze(-1)) & (y.unsqueeze(-1) >= 0)
    valid = (y.unsqueeze(-1) != -2) & (cols < k_real)
    sig = torch.sigmoid(p)
    sp = F.softplus(-p)
    bce = torch.where(pos, smoothing / 2, 1 - smoothing / 2) * p + sp
    q = torch.where(pos, 1 - sig, sig)
    coeff_f = torch.where(pos, alpha, 1 - alpha) * q.pow(gamma)
    coeff_b = torch.where(pos, -gamma * sig, gamma * (1 - sig))
    off_b = torch.where(pos, 1 - smoothing / 2, smoothing / 2) - sig
    loss = torch.where(valid, coeff_f * bce, 0).sum()
    grad = torch.where(valid, coeff_f * (coeff_b * bce - off_b), 0)
    return loss.to(torch.float32 if ct == torch.float32 else ct), grad.to(x.dtype)


def focal_loss_forward(cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor,
                       num_real_classes: int, alpha: float, gamma: float, label_smoothing: float = 0.0
                       ) -> tuple[Tensor, Tensor]:
    """``(loss, partial_grad)``: the normalised loss and the gradient before the ``grad / N⁺`` scaling."""
    return _forward(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                    label_smoothing)[:2]


def _forward(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
             label_smoothing):
    # (loss, partial_grad, whether the Triton kernel ran): the backward launches the same path without asking
    # for the backend again.
    _check(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma, label_smoothing)
    k = cls_output.shape[-1]
    if select(cls_output) == "triton" and cls_output.dtype != torch.float64:
        kernels = _kernels()
        two_d = cls_output.dim() == 2  # rows already: no reshapes in or out (~1-5 µs each)
        loss, grad = kernels.forward((cls_output if two_d else cls_output.reshape(-1, k)).contiguous(),
                                     (cls_targets_at_level if two_d else cls_targets_at_level.reshape(-1)
                                      ).contiguous(), num_positives_sum,
                                     num_real_classes, float(alpha), float(gamma), float(label_smoothing))
        return loss, grad if two_d else grad.view(cls_output.shape), True
    _check_targets(cls_targets_at_level, num_real_classes)
    loss, grad = _forward_torch(cls_output, cls_targets_at_level, num_real_classes, float(alpha), float(gamma),
                                float(label_smoothing))
    return loss / num_positives_sum.reshape(()).to(loss.dtype), grad, False


def focal_loss_backward(grad_output: Tensor, partial_grad: Tensor, num_positives_sum: Tensor) -> Tensor:
    """Scale ``partial_grad`` in place by ``grad_output / num_positives_sum`` and return it (Apex's
    ``focal_loss_cuda.backward``, which also reuses the buffer)."""
    if not isinstance(grad_output, torch.Tensor) or grad_output.numel() != 1:
        raise ValueError("grad_output must be a one-element tensor (the loss is a scalar)")
    if not isinstance(partial_grad, torch.Tensor) or not isinstance(num_positives_sum, torch.Tensor):
        raise TypeError("partial_grad and num_positives_sum must be tensors (focal_loss_forward's)")
    # The kernel reads them next to partial_grad, which it scales in place: a pointer of another device is an
    # illegal access there (and half the buffer would be written before PyTorch's path noticed).
    for name, t in (("grad_output", grad_output), ("num_positives_sum", num_positives_sum)):
        if not _same_device(t, partial_grad):
            raise RuntimeValueError(f"{name} is on {t.device} but partial_grad is on {partial_grad.device}")
    if select(partial_grad) == "triton" and partial_grad.dtype != torch.float64 and \
            partial_grad.is_contiguous():
        return _kernels().backward(grad_output, partial_grad, num_positives_sum)
    scale = grad_output.reshape(()).double() / num_positives_sum.reshape(()).double()
    if partial_grad.dtype == torch.float64:
        return partial_grad.mul_(scale)
    return partial_grad.copy_(partial_grad.float().mul_(scale.float()))


class FocalLoss(torch.autograd.Function):
    """``FocalLoss.apply(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
    label_smoothing=0.0)`` → 0-d loss."""

    @staticmethod
    def forward(ctx, cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha, gamma,
                label_smoothing=0.0):
        loss, partial_grad, ctx.triton = _forward(cls_output, cls_targets_at_level, num_positives_sum,
                                                  num_real_classes, alpha, gamma, label_smoothing)
        ctx.save_for_backward(partial_grad, num_positives_sum)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        partial_grad, num_positives_sum = ctx.saved_tensors
        # As Apex, the saved buffer is scaled in place and becomes the gradient: no second logits-sized buffer.
        # A second backward through the same graph is refused by autograd's version check on that buffer.
        if ctx.triton:  # the kernel's contiguous buffer and autograd's 0-d gradient: nothing to check
            grad = _kernels().backward(grad_loss, partial_grad, num_positives_sum)
        else:
            grad = focal_loss_backward(grad_loss, partial_grad, num_positives_sum)
        return grad, None, None, None, None, None, None


def focal_loss(cls_output: Tensor, cls_targets_at_level: Tensor, num_positive_sum: Tensor, num_real_classes: int,
               alpha: float, gamma: float, label_smoothing: float = 0.0) -> Tensor:
    """Fused focal loss (Apex's functional name and argument names)."""
    # Outside torch.func transforms and tracing, the C++ Function.apply without its Python wrapper (which
    # unwraps torch.func's dead wrappers, ~4 µs).
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return FocalLoss.apply(cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma,
                               label_smoothing)
    if not (torch.is_grad_enabled() and torch._C._any_requires_grad(cls_output)):
        # Nothing to record: the loss alone (its partial gradient dropped), without the Function's context.
        return _forward(cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma,
                        label_smoothing)[0]
    return _apply(cls_output, cls_targets_at_level, num_positive_sum, num_real_classes, alpha, gamma,
                  label_smoothing)


_apply = super(torch.autograd.Function, FocalLoss).apply


# ------------------------------------------------------------------- Apex's ``focal_loss_cuda`` entry points
def forward(cls_output: Tensor, cls_targets_at_level: Tensor, num_positives_sum: Tensor, num_real_classes: int,
            alpha: float, gamma: float, smoothing_factor: float) -> list[Tensor]:
    """``focal_loss_cuda.forward``: ``[loss, partial_grad]``."""
    return list(focal_loss_forward(cls_output, cls_targets_at_level, num_positives_sum, num_real_classes, alpha,
                                   gamma, smoothing_factor))


def backward(grad_output: Tensor, partial_grad: Tensor, num_positives_sum: Tensor) -> Tensor:
    """``focal_loss_cuda.backward``: the input gradient, written over ``partial_grad``."""
    return focal_loss_backward(grad_output, partial_grad, num_positives_sum)
