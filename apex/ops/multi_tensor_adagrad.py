"""Apex's ``multi_tensor_adagrad(chunk_size, noop_flag, tensor_lists, lr, epsilon, mode, weight_decay)``.

``tensor_lists`` is ``[grads, params, sums]``. Per element, in fp32::

    mode 0 (L2):       g = g + weight_decay * p ;  h = h + g² ;  p = p - lr * g / (sqrt(h) + eps)
    mode 1 (decoupled): h = h + g² ;  p = p - lr * (g / (sqrt(h) + eps) + weight_decay * p)

Mode 0 is ``torch.optim.Adagrad`` (``lr_decay=0``). ``noop_flag`` is ignored, as in Apex. The PyTorch path
calls ``torch._fused_adagrad_``; mode 1 first scales ``p`` by ``1 - lr * weight_decay`` (the same update,
decoupled decay applied to the old ``p``) and then runs the fused kernel without decay.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import check_noop_flag, check_tensor_lists, first_device


def multi_tensor_adagrad(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, epsilon: float,
                         mode: int, weight_decay: float, *, validate: bool = True) -> None:
    """``amp_C.multi_tensor_adagrad``: lists ``[grads, params, state_sums]``;
    ``sum += g²``, ``p -= lr * g / (sqrt(sum) + epsilon)``, with ``weight_decay`` added to the gradient
    (``mode`` 0, L2) or applied to the parameter (``mode`` 1, decoupled). Math in fp32. Nothing is updated
    when ``noop_flag`` is set.
    """
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked("adagrad", tensor_lists, lambda: check_tensor_lists(tensor_lists, 3))
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if mode not in (0, 1, True, False):
        raise ValueError(f"mode must be 0 (L2) or 1 (decoupled weight decay), got {mode!r}")
    if device is None or not tensor_lists[0]:
        return
    lists = list(tensor_lists)  # the inner lists as given: Columns from an optimizer stay Columns
    lr, epsilon, weight_decay, mode = float(lr), float(epsilon), float(weight_decay), int(mode)
    if _backend.select(lists[0]) == "triton":
        from apex._kernels import multi_tensor_adagrad as kernels

        kernels.adagrad(lists, lr, epsilon, mode, weight_decay)
        return
    with torch.no_grad():  # the fused op writes parameters that require grad
        _adagrad_torch(lists, lr, epsilon, mode, weight_decay, device)


def _adagrad_torch(lists, lr: float, epsilon: float, mode: int, weight_decay: float, device) -> None:
    g, p, h = lists
    keys = [(a.dtype, b.dtype, c.dtype) for a, b, c in zip(g, p, h)]
    for key in dict.fromkeys(keys):
        idx = [i for i, k in enumerate(keys) if k == key]
        gs, ps, hs = [g[i] for i in idx], [p[i] for i in idx], [h[i] for i in idx]
        # Work in the sums' dtype, or in fp32 when the decoupled pre-scaling of p would add a rounding.
        work = torch.float32 if (mode == 1 and weight_decay != 0.0) else key[2]
        work_p = ps if key[1] == work else [x.to(work) for x in ps]
        work_g = gs if key[0] == work else [x.to(work) for x in gs]
        work_h = hs if key[2] == work else [x.to(work) for x in hs]
        wd = weight_decay
        if mode == 1 and weight_decay != 0.0:
            torch._foreach_mul_(work_p, 1.0 - lr * weight_decay)
            wd = 0.0
        steps = [torch.ones((), dtype=torch.float32, device=device)] * len(idx)  # lr_decay=0: unused
        torch._fused_adagrad_(work_p, work_g, work_h, steps, lr=lr, lr_decay=0.0, weight_decay=wd, eps=epsilon,
                              maximize=False)
        if work_p is not ps:
            torch._foreach_copy_(ps, work_p)
        if work_h is not hs:
            torch._foreach_copy_(hs, work_h)
