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
from apex.ops._checks import check_noop_flag, check_tensor_lists


def _norms(x, n: int, name: str, device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.numel() < n:
        raise ValueError(f"{name} must be a tensor with one norm per tensor ({n}), got "
                         f"{x.numel() if isinstance(x, torch.Tensor) else type(x).__name__}")
    return x.reshape(-1).to(device=device, dtype=torch.float32)


@torch.no_grad()
def multi_tensor_lars(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, grad_norms: torch.Tensor,
                      param_norms: torch.Tensor, lr: float, trust_coefficient: float, epsilon: float,
                      weight_decay: float, momentum: float, dampening: float, nesterov: bool, first_run: bool,
                      wd_after_momentum: bool, scale: float, is_skipped: bool) -> None:
    device = check_tensor_lists(tensor_lists, (3, 4))
    check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    lists = [list(lst) for lst in tensor_lists]
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
    ok = (gn > 0) & (pn > 0)
    ratio = torch.where(ok, tc * pn / (gn + pn * wd + eps), torch.ones_like(pn))
    lrs = (lr * ratio).tolist()
    _lars_torch(lists, lrs, wd=wd, momentum=float(momentum), dampening=float(dampening),
                nesterov=bool(nesterov), first_run=bool(first_run), wd_after_momentum=bool(wd_after_momentum),
                scale=float(scale))


def _lars_torch(lists, lrs, *, wd, momentum, dampening, nesterov, first_run, wd_after_momentum, scale):
    g, w, buf = lists[:3]
    copies = lists[3] if len(lists) == 4 else None
    # fp32 tensors are used in place (gradients only read); others through fp32 copies.
    g32 = [x.float() for x in g]
    if scale != 1.0:
        g32 = torch._foreach_mul(g32, scale)
    w32 = [x if x.dtype == torch.float32 else x.float() for x in w]
    if wd != 0.0 and not wd_after_momentum:
        g32 = torch._foreach_add(g32, w32, alpha=wd)
    neg_lr_g = torch._foreach_mul(g32, [-v for v in lrs])
    if momentum != 0.0:
        b32 = [x if x.dtype == torch.float32 else x.float() for x in buf]
        if first_run:
            torch._foreach_copy_(b32, neg_lr_g)
        else:
            torch._foreach_mul_(b32, momentum)
            torch._foreach_add_(b32, neg_lr_g, alpha=1.0 - dampening)
        back = [i for i in range(len(buf)) if b32[i] is not buf[i]]
        if back:
            torch._foreach_copy_([buf[i] for i in back], [b32[i] for i in back])
        if nesterov:
            upd = torch._foreach_add(neg_lr_g, b32, alpha=momentum)
        else:
            upd = b32
    else:
        upd = neg_lr_g
    if wd != 0.0 and wd_after_momentum:
        decay = torch._foreach_mul(w32, [-v * wd for v in lrs])
        upd = torch._foreach_add(upd, decay)
    torch._foreach_add_(w32, upd)
    back = [i for i in range(len(w)) if w32[i] is not w[i]]
    if back:
        torch._foreach_copy_([w[i] for i in back], [w32[i] for i in back])
    if copies is not None:
        torch._foreach_copy_(copies, w32)
