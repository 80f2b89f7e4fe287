"""Apex's ``multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, wd, momentum, dampening, lr, nesterov,
first_run, wd_after_momentum, scale)``.

``tensor_lists`` is ``[grads, weights, momentum_buffers]`` or, with a fourth list, also the model copies
that receive the updated weights (Apex's fp32-master / fp16-model case). Per element, in fp32::

    g = grad * scale
    g = g + wd * w                                  (unless wd_after_momentum)
    if momentum != 0:
        buf = g if first_run else momentum * buf + (1 - dampening) * g
        g = g + momentum * buf if nesterov else buf
    g = g + wd * w                                  (if wd_after_momentum)
    w = w - lr * g ;  copy = w                      (copy: the optional fourth list)

Nothing is done when ``noop_flag`` is set. This is ``torch.optim.SGD``'s rule (its first step initialises
the buffer to the gradient), so the PyTorch path calls ``torch._fused_sgd_`` when the dtypes and options
allow, and ``torch._foreach_*`` otherwise.

Rounding (a deliberate choice, issue 22). fp32 weights, and fp32 masters with a fourth list of fp16 model
copies (amp O2), are computed exactly as above, in fp32. fp16/bf16 weights *without* a fourth list follow
``torch.optim.SGD`` bit for bit instead: every line above is one PyTorch operation whose result is rounded
to the storage dtype (``g*scale`` to the grad's, ``buf*momentum`` and then ``+ (1-dampening)*g`` to the
buffer's, the Nesterov/weight-decay sums and the new weight to the weight's), so the update uses the
*stored* (rounded) momentum. Apex's CUDA kernel instead feeds the unrounded fp32 momentum into the update,
which drifts from ``torch.optim.SGD`` by about an ulp per step; a drop-in replacement should not.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import check_noop_flag, check_tensor_lists, first_device
from apex.ops._fp32 import as_fp32, write_back


def multi_tensor_sgd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, wd: float, momentum: float,
                     dampening: float, lr: float, nesterov: bool, first_run: bool, wd_after_momentum: bool,
                     scale: float = 1.0, *, validate: bool = True) -> None:
    """``amp_C.multi_tensor_sgd``: lists ``[grads, params, momenta]`` (+ model copies for fp32 masters);
    one SGD step with ``wd``, ``momentum``, ``dampening``, ``nesterov``, gradients multiplied by ``scale``;
    ``first_run`` initialises the momenta with the gradient, ``wd_after_momentum`` applies weight decay to
    the update instead of the gradient. Math in fp32.
    """
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked("sgd", tensor_lists, lambda: check_tensor_lists(tensor_lists, (3, 4)))
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    lists = list(tensor_lists)  # the inner lists as given: Columns from an optimizer stay Columns
    args = dict(lr=float(lr), wd=float(wd), momentum=float(momentum), dampening=float(dampening),
                nesterov=bool(nesterov), first_run=bool(first_run), wd_after_momentum=bool(wd_after_momentum),
                scale=float(scale))
    if _backend.select(lists[0]) == "triton":
        from apex._kernels import multi_tensor_sgd as kernels

        kernels.sgd(noop_flag, lists, **args)
        return
    if bool(noop_flag.item()):
        return
    with torch.no_grad():  # the foreach ops write parameters that require grad
        sgd_torch(lists, **args, uniform=not validate)


def sgd_torch(lists, *, lr, wd, momentum, dampening, nesterov, first_run, wd_after_momentum, scale,
              uniform: bool = False) -> None:
    """``uniform``: the caller guarantees one dtype per list (an apex optimizer's bucket)."""
    g, w, buf = lists[:3]
    copies = lists[3] if len(lists) == 4 else None
    # torch._fused_sgd_ is only used for fp32: its CPU kernel loses ~5% relative accuracy on fp16/bf16
    # tensors of more than a few elements (torch 2.13), so reduced precision goes through fp32 copies.
    def dtypes(xs):
        return {xs[0].dtype} if uniform else {x.dtype for x in xs}

    fp32 = {torch.float32}
    if copies is None and dtypes(w) != fp32:
        low = [i for i, x in enumerate(w) if x.dtype != torch.float32]
        opts = dict(lr=lr, wd=wd, momentum=momentum, dampening=dampening, nesterov=nesterov,
                    first_run=first_run, wd_after_momentum=wd_after_momentum, scale=scale)
        if len(low) < len(w):  # a mixed list (amp_C called directly): the fp32 weights keep the fp32 rule
            rest = [i for i, x in enumerate(w) if x.dtype == torch.float32]
            sgd_torch([[lst[i] for i in rest] for lst in lists], **opts)
            lists = [[lst[i] for i in low] for lst in lists]
        _sgd_rounded_like_torch(*lists, **opts)
        return
    if (copies is None and scale == 1.0 and (wd == 0.0 or not wd_after_momentum)
            and dtypes(w) == fp32 and dtypes(g) == fp32 and (momentum == 0.0 or dtypes(buf) == fp32)):
        torch._fused_sgd_(w, g, buf if momentum != 0.0 else [], weight_decay=wd, momentum=momentum, lr=lr,
                          dampening=dampening, nesterov=nesterov, maximize=False, is_first_step=first_run)
        return
    # General case: fp32 working copies, one rounding per stored result.
    g32 = [x.float() * scale if scale != 1.0 else x.float().clone() for x in g]
    w32 = as_fp32(w)
    if wd != 0.0 and not wd_after_momentum:
        torch._foreach_add_(g32, w32, alpha=wd)
    if momentum != 0.0:
        if first_run:
            b32 = [x.clone() for x in g32]
        else:
            b32 = [x.float() if x.dtype != torch.float32 else x.clone() for x in buf]
            torch._foreach_mul_(b32, momentum)
            torch._foreach_add_(b32, g32, alpha=1.0 - dampening)
        if nesterov:
            torch._foreach_add_(g32, b32, alpha=momentum)
        else:
            g32 = [x.clone() for x in b32] if wd_after_momentum and wd != 0.0 else b32
        torch._foreach_copy_(buf, b32)
    if wd != 0.0 and wd_after_momentum:
        torch._foreach_add_(g32, w32, alpha=wd)
    torch._foreach_add_(w32, g32, alpha=-lr)
    write_back(w, w32)
    if copies is not None:
        torch._foreach_copy_(copies, w32)


def _sgd_rounded_like_torch(g, w, buf, *, lr, wd, momentum, dampening, nesterov, first_run, wd_after_momentum,
                            scale) -> None:
    """fp16/bf16 weights without master copies: ``torch.optim.SGD``'s own sequence of operations on the
    stored tensors (each computes in fp32 and rounds its result), so the results are PyTorch's bit for bit.
    The unscaling rounds ``g*scale`` to the grad's dtype, as ``GradScaler.unscale_`` does in place."""
    if scale != 1.0:
        g = torch._foreach_mul(g, scale)
    if wd != 0.0 and not wd_after_momentum:
        g = torch._foreach_add(g, w, alpha=wd)
    if momentum != 0.0:
        if first_run:
            torch._foreach_copy_(buf, g)
        else:
            # A 0-dim tensor, not a Python float: torch 2.13's in-place foreach multiply on CPU rounds a
            # Python scalar to fp16/bf16 first (0.9 -> 0.8999), which Tensor.mul_ (torch.optim.SGD) does not.
            torch._foreach_mul_(buf, torch.tensor(momentum, device=buf[0].device))
            torch._foreach_add_(buf, g, alpha=1.0 - dampening)
        g = torch._foreach_add(g, buf, alpha=momentum) if nesterov else buf
    if wd != 0.0 and wd_after_momentum:
        g = torch._foreach_add(g, w, alpha=wd)
    torch._foreach_add_(w, g, alpha=-lr)
