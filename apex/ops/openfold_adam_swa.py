"""One fused optimizer step for OpenFold: Adam on the state parameters, the result copied into the compute
parameters (the bf16 copies the model runs with), and an exponential SWA average of the result.

Per element, with ``g`` the gradient times ``grad_scale`` and ``bc1 = 1 − β1^t``, ``bc2 = 1 − β2^t``:

* mode 0 (Apex Adam): ``g += wd·p``; ``m = β1·m + (1−β1)·g``; ``v = β2·v + (1−β2)·g²``;
  ``p −= lr·(m/bc1) / (sqrt(v/bc2) + eps)``
* mode 1 (Apex AdamW): as mode 0 without the L2 term, and ``p −= lr·wd·p`` (decoupled, old ``p``)
* mode 2 (PyTorch Adam): as mode 0 with ``p −= (lr/bc1)·m / (sqrt(v)/sqrt(bc2) + eps)``
* then ``c = p`` (rounded to the compute dtype) and ``s = p`` on the first average, else
  ``s += (1 − decay)·(p − s)``.

Dtype policy: arithmetic in fp64 for fp64 state parameters, fp32 otherwise; the moments keep their dtype.
Paths: CUDA/ROCm tensors run one Triton launch per dtype group (``apex._kernels.openfold_adam_swa``);
CPU tensors run PyTorch's fused CPU Adam/AdamW (``torch._fused_adam_``, when bias correction is on and the
moments share the parameters' dtype) or ``torch._foreach_*`` operators, then a ``_foreach_copy_`` and a
``_foreach_lerp_``, per dtype group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from apex import _backend
from apex.ops._checks import check_tensor_lists

Tensor = torch.Tensor
MODES = (0, 1, 2)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # what the kernels take


def _group(lists):
    groups: dict = {}
    for i in range(len(lists[0])):
        if lists[0][i].numel() == 0:
            continue
        key = (lists[0][i].device,) + tuple(lst[i].dtype for lst in lists)
        subs = groups.setdefault(key, [[] for _ in lists])
        for sub, lst in zip(subs, lists):
            sub.append(lst[i])
    return list(groups.values())


def _step_torch(g, p, c, s, m, v, lr, beta1, beta2, eps, wd, bc1, bc2, decay, clip, mode, first, step):
    ct = torch.float64 if p[0].dtype == torch.float64 else torch.float32
    pw = p if p[0].dtype == ct else [x.to(ct) for x in p]
    mw = m if m[0].dtype == ct else [x.to(ct) for x in m]
    vw = v if v[0].dtype == ct else [x.to(ct) for x in v]
    if g[0].dtype == ct and clip is None:
        gw = list(g)  # read only below
    else:
        gw = [x.to(ct, copy=True) for x in g]  # a private copy: the caller's gradients stay untouched
        if clip is not None:
            torch._foreach_mul_(gw, clip.to(device=gw[0].device, dtype=ct) if isinstance(clip, Tensor) else clip)
    if step is not None and pw is p and mw is m and vw is v and p[0].device.type == "cpu":
        # PyTorch's fused CPU Adam/AdamW: one pass at the memory roofline. Apex's AdamW (p −= lr·wd·p_old
        # + lr·update) is AdamW's p·(1 − lr·wd) − lr·update; sqrt(v/bc2) = sqrt(v)/sqrt(bc2).
        fused = torch._fused_adamw_ if mode == 1 else torch._fused_adam_
        steps = [torch.tensor(float(step))] * len(p)
        fused(p, gw, m, v, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps, amsgrad=False,
              maximize=False)
        _copy_and_average(p, c, s, pw, ct, decay, first)
        return
    gw = [x.clone() for x in gw] if gw[0] is g[0] else gw
    if mode != 1 and wd != 0:
        torch._foreach_add_(gw, pw, alpha=wd)
    torch._foreach_mul_(mw, beta1)
    torch._foreach_add_(mw, gw, alpha=1.0 - beta1)
    torch._foreach_mul_(vw, beta2)
    torch._foreach_addcmul_(vw, gw, gw, value=1.0 - beta2)
    if mode == 2:
        denom = torch._foreach_sqrt(vw)
        torch._foreach_div_(denom, math.sqrt(bc2))
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(pw, mw, denom, value=-lr / bc1)
    else:
        denom = torch._foreach_div(vw, bc2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, eps)
        update = torch._foreach_div(mw, denom)
        torch._foreach_div_(update, bc1)
        if mode == 1 and wd != 0:
            torch._foreach_add_(update, pw, alpha=wd)
        torch._foreach_add_(pw, update, alpha=-lr)
    for dst, src in ((p, pw), (m, mw), (v, vw)):
        if dst is not src:
            torch._foreach_copy_(dst, src)
    _copy_and_average(p, c, s, pw, ct, decay, first)


def _copy_and_average(p, c, s, pw, ct, decay, first):
    torch._foreach_copy_(c, pw)
    if first:
        torch._foreach_copy_(s, pw)
    else:
        sw = s if s[0].dtype == ct else [x.to(ct) for x in s]
        torch._foreach_lerp_(sw, pw, 1.0 - decay)
        if sw is not s:
            torch._foreach_copy_(s, sw)


def adam_swa_step(grads: Sequence[Tensor], params: Sequence[Tensor], compute_params: Sequence[Tensor],
                  swa_params: Sequence[Tensor], exp_avgs: Sequence[Tensor], exp_avg_sqs: Sequence[Tensor], *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, bias_correction1: float,
                  bias_correction2: float, swa_decay_rate: float, first_average: bool, mode: int,
                  grad_scale: Tensor | float | None = None, step: int | None = None) -> None:
    """Update ``params``, ``compute_params``, ``swa_params``, ``exp_avgs``, ``exp_avg_sqs`` in place.

    ``step``: the step number when ``bias_correction1/2`` are ``1 − β^step`` (lets the CPU path use PyTorch's
    fused Adam); None when bias correction is off."""
    lists = [list(grads), list(params), list(compute_params), list(swa_params), list(exp_avgs), list(exp_avg_sqs)]
    n = len(lists[0])
    if any(len(lst) != n for lst in lists):
        raise ValueError(f"adam_swa_step: the six tensor lists must have equal lengths, got {[len(x) for x in lists]}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for i in range(n):
        shape = lists[1][i].shape
        for lst in lists:
            if lst[i].shape != shape:
                raise ValueError(f"tensor {i}: shapes differ across the lists ({list(lst[i].shape)} vs {list(shape)})")
    if n == 0:
        return
    if _backend.select(lists[1]) == "triton":
        from apex._kernels import openfold_adam_swa as kernels
        from apex._kernels._lists import checked

        # The kernels group the tensors by the gradients' device and read every list's tensors (and the
        # hyper-parameters, on the parameters' device) there: one of another device would be an illegal
        # access. Checked once per set of tensors (cached on their addresses), as the other optimizers' lists.
        lists = checked("openfold_adam_swa", lists, lambda: check_tensor_lists(lists, 6, name="adam_swa_step's lists",
                                                                               dtypes=_DTYPES))
        device = lists[1][0].device
        hyper = torch.tensor([lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2,
                              swa_decay_rate], dtype=torch.float64).to(device)
        if isinstance(grad_scale, Tensor):
            clip = grad_scale.reshape(1).to(device)
        else:
            clip = torch.tensor([1.0 if grad_scale is None else float(grad_scale)], dtype=torch.float64).to(device)
        kernels.adam_swa(lists, hyper, clip, mode, first_average)
        return
    for sub in _group(lists):
        _step_torch(*sub, float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                    float(bias_correction1), float(bias_correction2), float(swa_decay_rate), grad_scale,
                    mode, first_average, step)
