"""Apex's LAMB multi-tensor ops: ``multi_tensor_lamb``, ``multi_tensor_lamb_mp``,
``multi_tensor_lamb_stage1_cuda`` and ``multi_tensor_lamb_stage2_cuda``.

The update, per tensor ``i`` (all math in fp32, whatever the storage dtypes)::

    clip   = ‖g‖_global / max_grad_norm   if ‖g‖_global > max_grad_norm else 1
    ĝ      = g * inv_scale / clip  (+ weight_decay * p  in L2 mode, mode=0)
    m      = beta1 * m + beta3 * ĝ            beta3 = 1 - beta1 if grad_averaging else 1
    v      = beta2 * v + (1 - beta2) * ĝ²
    u      = (m / bc1) / (sqrt(v / bc2) + eps)  (+ weight_decay * p  in AdamW mode, mode=1)
    ratio  = lr * ‖p_i‖ / ‖u_i‖  if (use_nvlamb or weight_decay != 0) and both norms are non-zero, else lr
    p      = p - ratio * u

with ``bc1 = 1 - beta1**step``, ``bc2 = 1 - beta2**step`` (1 without bias correction). Unlike Apex's CUDA
kernels the gradients are not overwritten with the update. ``multi_tensor_lamb`` propagates infs/NaNs
like Apex; ``multi_tensor_lamb_mp`` skips the whole update when ``noop_flag`` is set (fp32 master
weights in list 1, the reduced-precision model copy in the optional list 4).
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops import _cpu_blocks, _lamb_cpu
from apex.ops._checks import FLOAT_DTYPES, check_noop_flag, check_tensor_lists, first_device, in_param_shapes
from apex.ops._cpu_norms import fp32_norms
from apex.ops._fp32 import as_fp32, write_back


def _check(noop_flag, tensor_lists, n_lists):
    device = check_tensor_lists(tensor_lists, n_lists, same_shape=True)
    check_noop_flag(noop_flag, device)
    return device


def _as_float(x, name: str) -> float:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got {x.numel()} elements")
        return float(x.item())
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(x).__name__}")
    return float(x)


def _check_norm_tensor(t, name: str, device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.numel() < 1 or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor holding the global gradient norm")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the tensors are on {device}")
    return t.reshape(-1)[:1].float()


def multi_tensor_lamb(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: float, beta1: float,
                      beta2: float, epsilon: float, step: int, bias_correction: int, weight_decay: float,
                      grad_averaging: int, mode: int, global_grad_norm: torch.Tensor, max_grad_norm: float,
                      use_nvlamb: bool | None = False, *, workspace: _cpu_blocks.Workspace | None = None,
                      validate: bool = True) -> None:
    """LAMB step on ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]`` (one dtype per tensor
    index; fp32/fp16/bf16). ``mode``: 0 = L2 regularisation, 1 = decoupled weight decay (AdamW).

    ``workspace`` (apex's addition): a ``_cpu_blocks.Workspace`` for the parameters' shapes that the
    PyTorch path reuses from call to call instead of building its buffers every call. ``validate=False``
    skips the per-tensor checks (for callers, such as apex's optimizers, that have made them, and that
    vouch for the workspace fitting the parameters)."""
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked("lamb", tensor_lists, lambda: _check(noop_flag, tensor_lists, 4),
                               shapes=True)
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    gn = _check_norm_tensor(global_grad_norm, "global_grad_norm", device)
    _run(noop_flag, *tensor_lists, None, lr=float(lr), beta1=float(beta1),
         beta2=float(beta2), eps=float(epsilon), step=int(step), bias_correction=bool(bias_correction),
         weight_decay=float(weight_decay), beta3=1.0 - float(beta1) if grad_averaging else 1.0,
         adam_w=bool(mode), grad_norm=gn, max_grad_norm=float(max_grad_norm), use_nvlamb=bool(use_nvlamb),
         inv_scale=None, skip_on_noop=False, workspace=workspace, trusted=not validate)


def multi_tensor_lamb_mp(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, lr: torch.Tensor,
                         beta1: float, beta2: float, epsilon: float, step: torch.Tensor, bias_correction: int,
                         weight_decay: float, grad_averaging: int, mode: int, global_grad_norm: torch.Tensor,
                         max_grad_norm: torch.Tensor, use_nvlamb: bool | None, found_inf: torch.Tensor,
                         inv_scale: torch.Tensor, *, workspace: _cpu_blocks.Workspace | None = None,
                         validate: bool = True) -> None:
    """Mixed-precision LAMB: ``tensor_lists = [grads, params, exp_avgs, exp_avg_sqs]`` or, with fp32 master
    weights, ``[grads, masters, exp_avgs, exp_avg_sqs, model_params]``. ``lr``, ``step``, ``max_grad_norm``
    and ``inv_scale`` are device tensors (no host synchronisation on the Triton path); gradients are
    multiplied by ``inv_scale``; nothing is updated when ``noop_flag`` is non-zero. ``workspace`` (apex's
    addition): a ``_cpu_blocks.Workspace`` for the masters' shapes, reused by the PyTorch path from call
    to call; ``validate=False`` skips the per-tensor checks."""
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked("lamb_mp", tensor_lists, lambda: _check_mp(tensor_lists), shapes=True)
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    lists = list(tensor_lists)  # the inner lists as given: Columns from an optimizer stay Columns
    gn = _check_norm_tensor(global_grad_norm, "global_grad_norm", device)
    tensors = {}
    named = (("lr", lr), ("step", step), ("max_grad_norm", max_grad_norm), ("inv_scale", inv_scale))
    for name, value in named:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(f"{name} must be a one-element tensor, got {value.numel()} elements")
            value = value.reshape(1).to(device)
        else:
            value = torch.full((1,), value, device=device,
                               dtype=torch.int32 if name == "step" else torch.float32)
        tensors[name] = value
    del found_inf  # Apex takes it but acts on noop_flag (which the optimizer fills from found_inf)
    out = lists[4] if len(lists) == 5 else None
    _run(noop_flag, *lists[:4], out, lr=tensors["lr"].float(), beta1=float(beta1), beta2=float(beta2),
         eps=float(epsilon), step=tensors["step"], bias_correction=bool(bias_correction),
         weight_decay=float(weight_decay), beta3=1.0 - float(beta1) if grad_averaging else 1.0,
         adam_w=bool(mode), grad_norm=gn, max_grad_norm=tensors["max_grad_norm"].float(),
         use_nvlamb=bool(use_nvlamb), inv_scale=tensors["inv_scale"].float(), skip_on_noop=True,
         workspace=workspace, trusted=not validate)


def _check_mp(tensor_lists) -> None:
    check_tensor_lists(tensor_lists, (4, 5), list_dtypes={0: FLOAT_DTYPES})
    for i, (a, b) in enumerate(zip(tensor_lists[0], tensor_lists[1])):
        if a.shape != b.shape:
            raise ValueError(f"tensor_lists[0][{i}] has shape {tuple(a.shape)} but tensor_lists[1][{i}] has "
                             f"shape {tuple(b.shape)}")


def _run(noop_flag, g, p, m, v, out, workspace=None, trusted=False, **kw) -> None:
    if _backend.select(p) == "triton":
        from apex._kernels import multi_tensor_lamb as kernels

        kernels.lamb(noop_flag, *(x if x is None or isinstance(x, (list, tuple)) else list(x)
                                  for x in (g, p, m, v, out)), **kw)
        return
    with torch.no_grad():  # the PyTorch path writes parameters that require grad
        g = in_param_shapes(g, p) if trusted else list(g)  # (the checks compare shapes)
        _run_torch(noop_flag, g, *(x if x is None else list(x) for x in (p, m, v, out)), workspace=workspace,
                   trusted=trusted, **kw)


def _run_torch(noop_flag, g, p, m, v, out, workspace=None, trusted=False, **kw) -> None:
    if _lamb_cpu.fusable(g, p, m, v, kw):
        _lamb_cpu.lamb_fused(noop_flag, g, p, m, v, out, workspace=workspace, trusted=trusted, **kw)
        return
    if not p[0].is_cpu:
        lamb_torch(noop_flag, g, p, m, v, out, **kw)
        return
    if kw.get("skip_on_noop") and bool(noop_flag.item()):
        return
    # Every tensor's update needs only its own norms (the global norm is given), so the CPU runs it block
    # by block on the workers: the fp32 copies of a block stay in the cache from pass to pass.
    kw["skip_on_noop"] = False
    parts = workspace.layout.blocks if workspace is not None and (trusted or workspace.fits(p)) else None
    orders = [b.order for b in parts] if parts is not None else _cpu_blocks.blocks(p)
    outs = out if out is not None else [None] * len(p)

    def part(g, p, m, v, out):
        lamb_torch(noop_flag, g, p, m, v, None if out[0] is None else out, **kw)

    with torch.inference_mode():
        _cpu_blocks.run(part, orders, g, p, m, v, outs)


def lamb_torch(noop_flag, g, p, m, v, out, *, lr, beta1, beta2, eps, step, bias_correction, weight_decay,
               beta3, adam_w, grad_norm, max_grad_norm, use_nvlamb, inv_scale=None,
               skip_on_noop=False) -> None:
    """The PyTorch path: ``torch._foreach_*`` ops in fp32 over the whole list (no per-tensor Python loop
    beyond dtype conversions)."""
    if skip_on_noop and bool(noop_flag.item()):
        return
    gn = grad_norm.reshape(()).float()
    maxn = max_grad_norm.reshape(()).float() if isinstance(max_grad_norm, torch.Tensor) else max_grad_norm
    clip = torch.where(gn > maxn, gn / maxn, torch.ones((), device=gn.device))
    if bias_correction:
        if isinstance(step, torch.Tensor):
            s = step.reshape(()).double()
            bc1 = (1.0 - torch.pow(beta1, s)).float()
            bc2 = (1.0 - torch.pow(beta2, s)).float()
        else:
            bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    else:
        bc1 = bc2 = 1.0
    sg = as_fp32(g)
    sg = [t.clone() if t is s else t for t, s in zip(sg, g)]  # never modify the gradients
    if inv_scale is not None:
        torch._foreach_mul_(sg, inv_scale.reshape(()))
    torch._foreach_div_(sg, clip)
    pf = as_fp32(p)
    if not adam_w and weight_decay != 0.0:
        torch._foreach_add_(sg, pf, alpha=weight_decay)
    mf, vf = as_fp32(m), as_fp32(v)
    torch._foreach_mul_(mf, beta1)
    torch._foreach_add_(mf, sg, alpha=beta3)
    torch._foreach_mul_(vf, beta2)
    torch._foreach_addcmul_(vf, sg, sg, value=1.0 - beta2)
    write_back(m, mf)
    write_back(v, vf)
    trust = use_nvlamb or weight_decay != 0.0
    if trust:  # the update is computed from the stored (possibly rounded) moments, as on the Triton path
        mf, vf = as_fp32(m), as_fp32(v)
    del sg
    denom = torch._foreach_div(vf, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    u = torch._foreach_div(mf, bc1)
    torch._foreach_div_(u, denom)
    del denom
    if adam_w and weight_decay != 0.0:
        torch._foreach_add_(u, pf, alpha=weight_decay)
    if trust:
        un = fp32_norms(u)
        pn = fp32_norms(pf)
        ratio = torch.where((un != 0) & (pn != 0), lr * (pn / un), lr * torch.ones_like(un))
        torch._foreach_mul_(u, list(ratio.unbind()))
    else:
        torch._foreach_mul_(u, lr.reshape(()) if isinstance(lr, torch.Tensor) else lr)
    torch._foreach_sub_(pf, u)
    write_back(p, pf)
    if out is not None:
        torch._foreach_copy_(out, pf)


@torch.no_grad()
def multi_tensor_lamb_stage1_cuda(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                  per_tensor_decay: torch.Tensor, step: int, beta1: float, beta2: float,
                                  epsilon: float, global_grad_norm: torch.Tensor,
                                  max_global_grad_norm: float) -> None:
    """Stage 1 of Apex's two-stage LAMB on ``[grads, params, exp_avgs, exp_avg_sqs, updates]``: updates the
    moments and writes ``update = m̂ / (sqrt(v̂) + eps) + per_tensor_decay[i] * p`` (bias corrections of
    ``step + 1``; grads divided by the clip factor of ``global_grad_norm``)."""
    from apex._kernels._lists import checked

    # (checked once per set of tensors: a caller's new lists of the same tensors every step cost one read)
    tensor_lists = checked("lamb_stage1", tensor_lists, lambda: check_tensor_lists(tensor_lists, 5))
    device = first_device(tensor_lists)
    check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    n = len(tensor_lists[0])
    if not isinstance(per_tensor_decay, torch.Tensor) or per_tensor_decay.numel() < n:
        raise ValueError(f"per_tensor_decay must be a tensor with one weight decay per tensor ({n})")
    gn = _check_norm_tensor(global_grad_norm, "global_grad_norm", device)
    g, p, m, v, upd = [x if isinstance(x, (list, tuple)) else list(x) for x in tensor_lists]
    maxn = float(max_global_grad_norm)
    s = int(step) + 1
    bc1, bc2 = 1.0 - float(beta1) ** s, 1.0 - float(beta2) ** s
    decay = per_tensor_decay.reshape(-1)[:n].to(device=device, dtype=torch.float32)
    if _backend.select(p) == "triton":
        from apex._kernels import multi_tensor_lamb as kernels

        kernels.stage1([g, p, m, v, upd], decay.contiguous(), gn, maxn, float(beta1), float(beta2), bc1, bc2,
                       float(epsilon))
        return
    clip = torch.where(gn[0] > maxn, gn[0] / maxn, torch.ones((), device=device))
    sg = [t.float() for t in g]
    torch._foreach_div_(sg, clip)
    mf, vf, pf = as_fp32(m), as_fp32(v), as_fp32(p)
    torch._foreach_mul_(mf, beta1)
    torch._foreach_add_(mf, sg, alpha=1.0 - beta1)
    torch._foreach_mul_(vf, beta2)
    torch._foreach_addcmul_(vf, sg, sg, value=1.0 - beta2)
    denom = torch._foreach_div(vf, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, epsilon)
    u = torch._foreach_div(mf, bc1)
    torch._foreach_div_(u, denom)
    torch._foreach_addcmul_(u, pf, list(decay.unbind()))
    write_back(m, mf)
    write_back(v, vf)
    torch._foreach_copy_(upd, u)


@torch.no_grad()
def multi_tensor_lamb_stage2_cuda(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                  per_tensor_param_norm: torch.Tensor, per_tensor_update_norm: torch.Tensor,
                                  lr: float, weight_decay: float, use_nvlamb: bool | None = False, *,
                                  validate: bool = True) -> None:
    """Stage 2 on ``[params, updates]``: ``p -= ratio_i * update`` with the trust ratio of stage 1's norms
    (applied when ``use_nvlamb`` or ``weight_decay != 0`` and both norms are non-zero, else ``lr``).
    ``validate=False`` skips the per-tensor checks (for apex's optimizers, which built the lists)."""
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked("lamb_stage2", tensor_lists, lambda: check_tensor_lists(tensor_lists, 2))
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    p, upd = [x if isinstance(x, (list, tuple)) else list(x) for x in tensor_lists]
    n = len(p)
    for name, t in (("per_tensor_param_norm", per_tensor_param_norm),
                    ("per_tensor_update_norm", per_tensor_update_norm)):
        if not isinstance(t, torch.Tensor) or t.numel() < n:
            raise ValueError(f"{name} must be a tensor with one norm per tensor ({n})")
    lr = float(lr)
    trust = bool(use_nvlamb) or float(weight_decay) != 0.0
    pn = per_tensor_param_norm.reshape(-1)[:n].float().to(device)
    un = per_tensor_update_norm.reshape(-1)[:n].float().to(device)
    if _backend.select(p) == "triton":
        from apex._kernels import multi_tensor_lamb as kernels

        kernels.stage2([p, upd], pn.contiguous(), un.contiguous(), lr, trust)
        return
    pf, uf = as_fp32(p), as_fp32(upd)
    if trust:
        ratio = torch.where((un != 0) & (pn != 0), lr * (pn / un), torch.full_like(un, lr))
        torch._foreach_addcmul_(pf, uf, list(ratio.unbind()), value=-1.0)
    else:
        torch._foreach_add_(pf, uf, alpha=-lr)
    write_back(p, pf)
