"""ROCm Apex's ``multi_tensor_lars(chunk_size, noop_flag, tensor_lists, grad_norms, param_norms, lr,
trust_coefficient, epsilon, weight_decay, momentum, dampening, nesterov, first_run, wd_after_momentum,
scale, is_skipped)``: SGD with a layer-wise learning rate (LARS).

``tensor_lists`` is ``[grads, weights, momentum_buffers]`` (plus model copies receiving the weights);
``grad_norms[i]``/``param_norms[i]`` are the L2 norms of tensor ``i``. Per tensor::

    lr_i = lr * trust_coefficient * ‖w‖ / (‖g‖ + weight_decay * ‖w‖ + epsilon)   (lr if a norm is 0
                                                                                  or is_skipped)

and per element, in fp32 (ROCm's sign convention: the buffer holds the negative step)::

    g = grad * scale (+ weight_decay * w unless wd_after_momentum)
    buf = -lr_i * g on the first step, else momentum * buf - lr_i * (1 - dampening) * g
    step = momentum * buf - lr_i * g (nesterov), buf (momentum), or -lr_i * g (no momentum)
    step = step - lr_i * weight_decay * w                         (wd_after_momentum)
    w = w + step

ROCm's kernel ignores ``dampening``, ``nesterov``, ``first_run`` and ``wd_after_momentum`` and does not move
the weights at all without momentum; here they have their SGD meaning. Nothing is done when
``noop_flag`` is set.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import check_noop_flag, check_tensor_lists, first_device, in_param_shapes
from apex.ops._fp32 import as_fp32, write_back


def _norms(x, n: int, name: str, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.numel() < n:
        raise ValueError(f"{name} must be a tensor with one norm per tensor ({n}), got "
                         f"{x.numel() if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x.reshape(-1).to(device=device, dtype=torch.float32)


def multi_tensor_lars(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, grad_norms: torch.Tensor,
                      param_norms: torch.Tensor, lr: float, trust_coefficient: float, epsilon: float,
                      weight_decay: float, momentum: float, dampening: float, nesterov: bool, first_run: bool,
                      wd_after_momentum: bool, scale: float, is_skipped: bool, *, validate: bool = True) -> None:
    """``validate=False`` (apex's addition) skips the per-tensor checks, for callers such as apex's
    ``FusedLARS`` that have made them."""
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked("lars", tensor_lists, lambda: check_tensor_lists(tensor_lists, (3, 4)))
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    lists = list(tensor_lists)  # the inner lists as given: Columns from an optimizer stay Columns
    n = len(lists[0])
    gn = _norms(grad_norms, n, "grad_norms", device)[:n]
    pn = _norms(param_norms, n, "param_norms", device)[:n]
    lr, tc, eps, wd = float(lr), float(trust_coefficient), float(epsilon), float(weight_decay)
    if is_skipped:
        # Exactly lr for every tensor: norms that never pass the "both positive" test.
        gn = torch.zeros_like(gn)
    if _backend.select(lists[0]) == "triton":
        from apex._kernels import multi_tensor_sgd as kernels

        kernels.sgd(noop_flag, lists, lr=lr, wd=wd, momentum=float(momentum), dampening=float(dampening),
                    nesterov=bool(nesterov), first_run=bool(first_run),
                    wd_after_momentum=bool(wd_after_momentum), scale=float(scale), grad_norms=gn,
                    param_norms=pn, trust_coefficient=tc, eps=eps, lars=True)
        return
    if bool(noop_flag.item()):
        return
    if not validate:  # (the checks compare shapes)
        lists[0] = in_param_shapes(lists[0], lists[1])
    ok = (gn > 0) & (pn > 0)
    ratio = torch.where(ok, tc * pn / (gn + pn * wd + eps), torch.ones_like(pn))
    with torch.no_grad():  # the foreach ops write parameters that require grad
        _lars_torch(lists, (lr * ratio).float(), wd=wd, momentum=float(momentum), dampening=float(dampening),
                    nesterov=bool(nesterov), first_run=bool(first_run), wd_after_momentum=bool(wd_after_momentum),
                    scale=float(scale))


def _lars_torch(lists, lrs: torch.Tensor, *, wd, momentum, dampening, nesterov, first_run, wd_after_momentum,
                scale):
    """In-place ``torch._foreach_*`` ops in fp32 with the per-tensor rates as 0-dim tensors, so no
    temporary of the parameters' size: with ``d = scale * g (+ wd * w)``,

    * momentum: ``buf = momentum * buf - (1 - dampening) * lr_i * d`` (``-lr_i * d`` on the first run), then
      ``w += buf``, or with nesterov ``w += momentum * buf - lr_i * d``;
    * no momentum: ``w -= lr_i * d``;

    and ``w -= lr_i * wd * w`` (the old ``w``) with ``wd_after_momentum``. The gradients are only read;
    other dtypes go through fp32 copies."""
    g, w, buf = lists[:3]
    copies = lists[3] if len(lists) == 4 else None
    rates = list(lrs.unbind())
    w32 = as_fp32(w)
    # The terms of -lr_i * d in w's update come from the old w, so they go first; buf's from the old w too.
    wd_in_d = wd != 0.0 and not wd_after_momentum
    if momentum != 0.0:
        b32 = as_fp32(buf)
        if first_run:
            torch._foreach_zero_(b32)
            k = 1.0
        else:
            torch._foreach_mul_(b32, momentum)
            k = 1.0 - dampening
        torch._foreach_addcmul_(b32, g, rates, value=-k * scale)
        if wd_in_d:
            torch._foreach_addcmul_(b32, w32, rates, value=-k * wd)
        write_back(buf, b32)
        if wd != 0.0 and (nesterov or wd_after_momentum):  # -lr_i * wd * w, from d (nesterov) or after
            torch._foreach_addcmul_(w32, w32, rates, value=-wd)
        if nesterov:
            torch._foreach_addcmul_(w32, g, rates, value=-scale)
            torch._foreach_add_(w32, b32, alpha=momentum)
        else:
            torch._foreach_add_(w32, b32)
    else:
        if wd != 0.0:
            torch._foreach_addcmul_(w32, w32, rates, value=-wd)
        torch._foreach_addcmul_(w32, g, rates, value=-scale)
    write_back(w, w32)
    if copies is not None:
        torch._foreach_copy_(copies, w32)
