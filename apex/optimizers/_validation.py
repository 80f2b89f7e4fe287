"""Hyper-parameter validation shared by apex's optimizers: a ``ValueError`` (``TypeError`` for a value that is not a
number) naming the argument."""

from __future__ import annotations

import math

import torch
from torch.optim.optimizer import required


def _number(value, name: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got {value.numel()} elements")
        return float(value.detach().cpu().item())
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def check_non_negative(value, name: str) -> None:
    v = _number(value, name)
    if not v >= 0.0 or math.isinf(v):
        raise ValueError(f"Invalid {name}: {value!r} (expected a finite number >= 0)")


def check_betas(betas, name: str = "betas") -> None:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"Invalid {name}: {betas!r} (expected a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        v = _number(b, f"{name}[{i}]")
        if not 0.0 <= v < 1.0:
            raise ValueError(f"Invalid beta parameter at index {i}: {b!r} ({name}[{i}] must be in [0, 1))")


def check_sgd_hyperparameters(lr, momentum, dampening, weight_decay, nesterov) -> None:
    """The arguments FusedSGD and FusedLARS share (``lr`` may be ``torch.optim.optimizer.required``)."""
    if lr is not required:
        check_non_negative(lr, "lr")
    check_non_negative(momentum, "momentum")
    check_non_negative(weight_decay, "weight_decay")
    check_non_negative(dampening, "dampening")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("Nesterov momentum requires a momentum and zero dampening")
