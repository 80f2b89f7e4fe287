"""``torch.amp.GradScaler``'s side of a fused optimizer's ``step(grad_scaler=...)`` (Apex's protocol): the
scaler's inf check of the gradients (apex's own kernel where the Triton path runs) and its scale."""

from __future__ import annotations

import torch

from apex import _backend


def scaler_state(optimizer: torch.optim.Optimizer, grad_scaler, device: torch.device, grads: list | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(found_inf, scale)``, fp32 one-element tensors on ``device``, from a ``torch.amp.GradScaler``
    passed to ``optimizer.step`` (Apex's protocol): its inf check of the optimizer's gradients (any device)
    and its scale, or, when ``grad_scaler.unscale_(optimizer)`` already ran, that call's check and 1.
    ``grads``: the step's gradient lists, when the caller has them (else read from the param groups)."""
    from torch.amp.grad_scaler import OptState

    opt_state = grad_scaler._per_optimizer_states[id(optimizer)]
    if opt_state["stage"] is OptState.UNSCALED:
        per_dev = opt_state["found_inf_per_device"]
        scale = torch.ones(1, dtype=torch.float32, device=device)
    else:
        per_dev = check_inf_per_device(optimizer, grad_scaler, grads)
        scale = grad_scaler._get_scale_async().to(device=device, dtype=torch.float32).reshape(1)
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for t in per_dev.values():
        found = found + t.to(device=device, dtype=torch.float32).reshape(1)
    return found, scale


def check_inf_per_device(optimizer: torch.optim.Optimizer, grad_scaler, grads: list | None = None) -> dict:
    """``grad_scaler._check_inf_per_device(optimizer)``: ``{device: found_inf}`` (0-d fp32, 1 where a
    gradient on that device holds an inf or NaN), recorded in the scaler for its ``update()``.

    Where apex's Triton path runs (GPUs) the check is apex's own multi-tensor kernel (``multi_tensor_scale``
    by 1 in place, which flags a non-finite input), as PyTorch's check is its unscale by 1: PyTorch's CUDA
    ``_amp_foreach_non_finite_check_and_unscale_`` has no bfloat16 kernel, and bf16 gradients are what a
    GradScaler meets with bf16 models. Like PyTorch's, it stays on the device (no host synchronisation, so
    a capturable step can be captured in a CUDA graph). Elsewhere PyTorch's check runs, unchanged."""
    if grads is None:
        grads = [[p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]]
    lists = [lst for lst in grads if len(lst)]
    if not lists or _backend.select(lists[0]) != "triton":
        return grad_scaler._check_inf_per_device(optimizer)
    from apex.ops.multi_tensor_scale import multi_tensor_scale

    flags: dict = {}
    for lst in lists:
        if all(g.device == lst[0].device for g in lst):
            by_dev = {lst[0].device: lst}
        else:
            by_dev = {}
            for g in lst:
                by_dev.setdefault(g.device, []).append(g)
        for device, gs in by_dev.items():
            flag = flags.get(device)
            if flag is None:
                flag = flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
            multi_tensor_scale(2048 * 32, flag, [gs, gs], 1.0)
    found = {device: flag.to(torch.float32).reshape(()) for device, flag in flags.items()}
    grad_scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = found
    return found
