"""Checks shared by FusedLAMB, FusedMixedPrecisionLamb and FusedNovoGrad.

Every check of a step runs before anything is modified, so a failed step leaves parameters, state and
step counters as they were.
"""

from __future__ import annotations

import torch

from apex.optimizers._base import _number, check_betas, check_non_negative

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ParamMismatchError(RuntimeError, ValueError):
    """A gradient that does not fit its parameter, or a parameter group spread over devices.

    Both a ``RuntimeError`` (what PyTorch raises for such tensors) and a ``ValueError`` (bad input)."""


def check_hyperparameters(*, lr, betas, eps, weight_decay, max_grad_norm=None, amsgrad=False,
                          name: str = "FusedLAMB") -> None:
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")
    check_non_negative(lr, "lr")
    check_non_negative(eps, "eps")
    check_betas(betas)
    check_non_negative(weight_decay, "weight_decay")
    if max_grad_norm is not None and not 0.0 < _number(max_grad_norm, "max_grad_norm"):
        raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (expected max_grad_norm > 0)")


def check_group_hyperparameters(optimizer: torch.optim.Optimizer, param_group: dict) -> None:
    """``check_hyperparameters`` for a group given to ``add_param_group`` (missing keys: the defaults)."""
    check_hyperparameters(**{k: param_group.get(k, optimizer.defaults[k]) for k in ("lr", "betas", "eps",
                                                                                     "weight_decay")})


def params_with_grads(optimizer: torch.optim.Optimizer, name: str,
                      dtypes=SUPPORTED_DTYPES) -> list[list[torch.Tensor]]:
    """For each param group, its parameters that have a gradient, after checking every one of them."""
    out = []
    for gi, group in enumerate(optimizer.param_groups):
        params = group["params"]
        device = params[0].device if params else None
        ps = []
        for pi, p in enumerate(params):
            g = p.grad
            # One cheap test per parameter; the message is built only when it fails.
            if p.dtype not in dtypes or p.device != device or (
                    g is not None and (g.layout != torch.strided or g.dtype != p.dtype or g.shape != p.shape
                                       or g.device != device)):
                _diagnose(name, gi, pi, p, device, dtypes)
            if g is not None:
                ps.append(p)
        out.append(ps)
    return out


def _diagnose(name: str, gi: int, pi: int, p: torch.Tensor, device, dtypes) -> None:
    where = f"param_groups[{gi}]['params'][{pi}]"
    if p.dtype not in dtypes:
        raise RuntimeError(f"{name} supports {', '.join(map(str, dtypes))} parameters; {where} is {p.dtype}")
    if p.device != device:
        raise ParamMismatchError(f"{name}: {where} is on {p.device} but the group's first parameter is on "
                                 f"{device}; a parameter group must live on one device")
    g = p.grad
    if g.layout != torch.strided:
        raise RuntimeError(f"{name} does not support sparse gradients, please consider SparseAdam instead")
    raise ParamMismatchError(
        f"{name}: the gradient of {where} is {g.dtype} {tuple(g.shape)} on {g.device} but the parameter is "
        f"{p.dtype} {tuple(p.shape)} on {p.device}")


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """``p.grad`` in the contiguous layout the multi-tensor ops need (a copy only when it is strided)."""
    g = p.grad
    return g if g.is_contiguous() else g.contiguous()
