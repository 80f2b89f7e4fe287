"""Apex's legacy ``fused_lamb_cuda.lamb`` (the contrib LAMB kernel), with its positional signature.

It is ``multi_tensor_lamb`` (``apex.ops.multi_tensor_lamb``) with two differences of interface only:
``global_grad_norm`` is a Python float (or a one-element tensor), and there is no ``use_nvlamb`` argument:
the trust ratio applies to tensors with non-zero weight decay only, which is ``use_nvlamb=False``. The
math, dtype policy and backends are ``multi_tensor_lamb``'s.
"""

from __future__ import annotations

import torch

from apex.ops._checks import first_device
from apex.ops.multi_tensor_lamb import multi_tensor_lamb

__all__ = ["lamb"]


@torch.no_grad()
def lamb(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, beta1: float, beta2: float,
         epsilon: float, step: int, bias_correction: int, weight_decay: float, grad_averaging: int, mode: int,
         global_grad_norm: float, max_grad_norm: float) -> None:
    """LAMB step on ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]``; see ``multi_tensor_lamb``."""
    device = first_device(tensor_lists)
    if device is None:
        return
    if isinstance(global_grad_norm, torch.Tensor):
        norm = global_grad_norm.to(device=device, dtype=torch.float32).reshape(-1)[:1]
    else:
        try:
            norm = torch.tensor([float(global_grad_norm)], device=device)
        except (TypeError, ValueError):
            raise TypeError(f"global_grad_norm must be a number, got {type(global_grad_norm).__name__}") from None
    multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, bias_correction,
                      weight_decay, grad_averaging, mode, norm, max_grad_norm, False)
