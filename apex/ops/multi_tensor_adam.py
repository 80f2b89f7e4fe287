"""Apex's Adam updates over lists of tensors: ``multi_tensor_adam``, ``multi_tensor_adam_capturable`` and
``multi_tensor_adam_capturable_master``.

``tensor_lists`` is ``[grads, params, exp_avgs, exp_avg_sqs]`` (plus ``master_params`` for the master
variant, and accepted by ``multi_tensor_adam`` too). For every element, in fp32 whatever the storage dtype::

    g = grad * inv_scale                               (capturable variants; the unscaled g is written back)
    mode 0 (L2):    g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    update = (m / bc1) / (sqrt(v / bc2) + eps)         bc_i = 1 - beta_i ** step, or 1 without bias correction
    mode 1 (AdamW): update = update + weight_decay * p
    p = p - lr * update

``p`` is the fp32 master weight when a master list is given (the model parameter receives its rounded
copy). ``exp_avg``/``exp_avg_sq`` may be fp32 for fp16/bf16 parameters (Apex's layout). The capturable
variants take ``lr`` and ``step`` as one-element device tensors and do nothing when ``noop_flag`` is set;
``multi_tensor_adam`` ignores ``noop_flag`` and propagates infs and NaNs, as Apex does.

Every op also takes ``validate=False`` (keyword only), used by apex's optimizers, which check the tensors
once per step themselves and pass lists of one dtype each.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import as_scalar_tensor, check_noop_flag, check_tensor_lists, first_device


def multi_tensor_adam(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, mode: int, bias_correction: int,
                      weight_decay: float, *, validate: bool = True) -> None:
    """``amp_C.multi_tensor_adam``: lists ``[grads, params, exp_avgs, exp_avg_sqs]`` (+ fp32 masters);
    one Adam (``mode`` 0, L2) or AdamW (``mode`` 1) step with ``bias_correction`` 0/1 at ``step``.
    Math in fp32; parameters may be fp32, fp16 or bf16.
    """
    _adam(noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay,
          inv_scale=None, capturable=False, n_lists=(4, 5), validate=validate)


def multi_tensor_adam_capturable(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: torch.Tensor,
                                 beta1: float, beta2: float, epsilon: float, step: torch.Tensor, mode: int,
                                 bias_correction: int, weight_decay: float, inv_scale: torch.Tensor, *,
                                 validate: bool = True) -> None:
    """``amp_C.multi_tensor_adam_capturable``: as :func:`multi_tensor_adam` with ``lr`` and ``step``
    as device tensors and the gradients multiplied by ``inv_scale`` first (CUDA-graph capturable; nothing
    is written when the unscaled gradients are not finite).
    """
    _adam(noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay,
          inv_scale=inv_scale, capturable=True, n_lists=4, validate=validate)


def multi_tensor_adam_capturable_master(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                        lr: torch.Tensor, beta1: float, beta2: float, epsilon: float,
                                        step: torch.Tensor, mode: int, bias_correction: int,
                                        weight_decay: float, inv_scale: torch.Tensor, *,
                                        validate: bool = True) -> None:
    """``amp_C.multi_tensor_adam_capturable_master``: as :func:`multi_tensor_adam_capturable` with a
    fifth list of fp32 master parameters, which are updated and copied to the half parameters.
    """
    _adam(noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, mode, bias_correction, weight_decay,
          inv_scale=inv_scale, capturable=True, n_lists=5, validate=validate)


def _adam(noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode, bias_correction, weight_decay, *,
          inv_scale, capturable: bool, n_lists, validate: bool = True) -> None:
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked(("adam", n_lists), tensor_lists, lambda: _check_lists(tensor_lists, n_lists))
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if mode not in (0, 1, True, False):
        raise ValueError(f"mode must be 0 (L2) or 1 (AdamW), got {mode!r}")
    if device is None or not tensor_lists[0]:
        return
    lists = list(tensor_lists)  # the inner lists as given: Columns from an optimizer stay Columns
    g = lists[0]
    mode = int(mode)
    bias_correction = int(bool(bias_correction))
    beta1, beta2, eps, weight_decay = float(beta1), float(beta2), float(eps), float(weight_decay)
    if capturable:
        lr_t = _scalar(lr, device, "lr")
        step_t = _scalar(step, device, "step")
        inv_t = _scalar(inv_scale, device, "inv_scale")
    if _backend.select(g) == "triton":
        from apex._kernels import multi_tensor_adam as kernels

        if capturable:
            kernels.adam(noop_flag, lists, lr_t, step_t, inv_t, 0.0, 1.0, 1.0, beta1, beta2, eps,
                         weight_decay, mode, bias_correction, capturable=True)
        else:
            bc1, bc2 = _bias_corrections(beta1, beta2, step, bias_correction)
            kernels.adam(noop_flag, lists, None, None, None, float(lr), bc1, bc2, beta1, beta2, eps,
                         weight_decay, mode, bias_correction, capturable=False)
        return
    with torch.no_grad():  # the foreach/fused ops write parameters that require grad
        if capturable:
            _adam_torch(lists, lr_t, step_t, beta1, beta2, eps, weight_decay, mode, bias_correction,
                        grad_scale=inv_t.double().reciprocal().float(), found_inf=noop_flag.float())
        else:
            _adam_torch(lists, float(lr), float(step), beta1, beta2, eps, weight_decay, mode, bias_correction,
                        grad_scale=None, found_inf=None)


def _scalar(value, device, name: str) -> torch.Tensor:
    """``as_scalar_tensor``, without an op for what is already a one-element fp32 tensor on ``device`` (the
    kernel reads its one element): an optimizer's device-side lr, step and scale."""
    if type(value) is torch.Tensor and value.dtype is torch.float32 and value.device == device \
            and value.numel() == 1:
        return value
    return as_scalar_tensor(value, device, name)


def _check_lists(tensor_lists, n_lists) -> None:
    """The checks of a call from outside apex (run once per new set of tensors, see ``_lists.checked``)."""
    check_tensor_lists(tensor_lists, n_lists, same_shape=False, list_dtypes={4: (torch.float32,)})
    lists = tensor_lists
    p = lists[1]
    for i in range(len(lists[0])):
        if lists[2][i].dtype != lists[3][i].dtype:
            raise TypeError(f"tensor_lists[2][{i}] and tensor_lists[3][{i}] (exp_avg, exp_avg_sq) must share "
                            f"a dtype, got {lists[2][i].dtype} and {lists[3][i].dtype}")
        if len(lists) == 4 and lists[2][i].dtype not in (torch.float32, p[i].dtype):
            raise TypeError(f"tensor_lists[2][{i}] must be float32 or the parameter's dtype {p[i].dtype}")


def _bias_corrections(beta1: float, beta2: float, step, bias_correction: int) -> tuple[float, float]:
    if not bias_correction:
        return 1.0, 1.0
    s = float(step)
    return 1.0 - beta1 ** s, 1.0 - beta2 ** s


def _adam_torch(lists, lr, step, beta1, beta2, eps, weight_decay, mode, bias_correction, *, grad_scale,
                found_inf) -> None:
    """PyTorch path: ``torch._fused_adam_``/``torch._fused_adamw_`` on fp32 views of the update.

    PyTorch's fused kernels compute the same update (AdamW's ``p *= 1 - lr*wd`` then ``p -= lr*m̂/(√v̂+eps)``
    equals Apex's ``p -= lr*(m̂/(√v̂+eps) + wd*p)``), with ``m``, ``v`` and ``p`` of one dtype. Reduced-
    precision parameters with fp32 state are updated through fp32 copies and rounded back once, which is
    what Apex's kernel does in registers. Without bias correction the step is passed as +inf, for which
    ``1 - beta ** step`` is exactly 1.
    """
    g, p, m, v = lists[:4]
    master = lists[4] if len(lists) == 5 else None
    fused = torch._fused_adamw_ if mode == 1 else torch._fused_adam_
    device = p[0].device
    if isinstance(step, torch.Tensor):
        step_t = step.to(torch.float32).reshape(())
        if not bias_correction:
            step_t = torch.full((), float("inf"), device=device)
    else:
        step_t = torch.tensor(float(step) if bias_correction else float("inf"), device=device)
    # Group by the dtypes the fused kernel will see: (grad, param) pairs of one dtype with state in it.
    keys = []
    for i in range(len(p)):
        keys.append((g[i].dtype, p[i].dtype, m[i].dtype, master is not None))
    buckets: dict = {}
    for i, k in enumerate(keys):
        buckets.setdefault(k, []).append(i)
    for (gd, _, _, has_master), idx in buckets.items():
        gs = [g[i] for i in idx]
        ms = [m[i] for i in idx]
        vs = [v[i] for i in idx]
        work_p = [master[i] for i in idx] if has_master else [p[i] for i in idx]
        work_dtype = ms[0].dtype
        if work_p[0].dtype != work_dtype:
            work_p = [x.to(work_dtype) for x in work_p]
        work_g = gs if gd == work_dtype else [x.to(work_dtype) for x in gs]
        fused(work_p, work_g, ms, vs, [], [step_t] * len(idx), lr=lr, beta1=beta1, beta2=beta2,
              weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
              found_inf=found_inf)
        if work_g is not gs and grad_scale is not None:
            torch._foreach_copy_(gs, work_g)  # Apex writes the unscaled gradient back
        targets = [p[i] for i in idx]
        if work_p[0] is not targets[0]:
            torch._foreach_copy_(targets, work_p)
