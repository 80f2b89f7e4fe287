"""Upstream's ``distributed_lamb_cuda`` kernels with their positional signatures (for code that calls them
directly; ``DistributedFusedLAMB`` itself uses ``apex.ops.multi_tensor_lamb``).

``multi_tensor_lamb_compute_update_term`` on ``[g, p, m, v, u]``, per tensor ``i`` (fp32 math)::

    s  = global_scale / min(1, max_grad_norm / (global_grad_norm / global_scale + 1e-6))   (s = global_scale
         when max_grad_norm <= 0)
    ĝ  = g / s  (+ decay_i * p in mode 0)
    m  = beta1_i * m + (1 - beta1_i) * ĝ ;  v = beta2_i * v + (1 - beta2_i) * ĝ²
    u  = (m / bc1) / (sqrt(v / bc2) + eps_i)  (+ decay_i * p in mode 1)

(``bc = 1 - beta**step`` where bias correction is on; like upstream's kernel, ``beta3`` is taken as
``1 - beta1`` whatever is passed). ``multi_tensor_lamb_update_weights`` on ``[u, p, p_copy]``:
``p -= ratio_i * u`` with ``ratio_i = lr * param_norm[i] / update_norm[offset[i]]`` where ``use_nvlamb`` or
``decay_i != 0`` and both norms are non-zero (else ``lr``), then ``p_copy = p`` (a ``uint8`` ``p_copy``
receives upstream's e5m2 byte: the high byte of the fp16 value after rounding). Both do nothing when
``noop_flag`` is set.
"""

from __future__ import annotations

import torch

from apex.ops._checks import FLOAT_DTYPES, check_noop_flag, check_tensor_lists
from apex.ops._fp32 import as_fp32, write_back
from apex.ops.multi_tensor_lamb import multi_tensor_lamb_stage2_cuda


def _per_tensor(t, n: int, name: str) -> list:
    if not isinstance(t, torch.Tensor) or t.numel() < n:
        raise ValueError(f"{name} must be a tensor with one value per tensor ({n})")
    return t.reshape(-1)[:n].tolist()


def _scalar(t, name: str) -> float:
    if isinstance(t, torch.Tensor):
        if t.numel() < 1:
            raise ValueError(f"{name} must hold a value")
        return float(t.reshape(-1)[0])
    return float(t)


@torch.no_grad()
def multi_tensor_lamb_compute_update_term(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                          per_tensor_beta1: torch.Tensor, per_tensor_beta2: torch.Tensor,
                                          per_tensor_beta3: torch.Tensor, per_tensor_bias_correction: torch.Tensor,
                                          step: torch.Tensor, per_tensor_epsilon: torch.Tensor, mode: int,
                                          per_tensor_decay: torch.Tensor, global_scale: torch.Tensor,
                                          global_grad_norm: torch.Tensor, max_grad_norm: float) -> None:
    """``distributed_lamb_cuda.multi_tensor_lamb_compute_update_term``: the LAMB update term ``u`` of each
    tensor from ``[g, p, m, v, u]`` (see the module docstring), updating ``m`` and ``v`` in place."""
    device = check_tensor_lists(tensor_lists, 5)
    check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0] or int(noop_flag.reshape(-1)[0]):
        return
    g, p, m, v, u = [list(x) for x in tensor_lists]
    n = len(g)
    b1 = _per_tensor(per_tensor_beta1, n, "per_tensor_beta1")
    b2 = _per_tensor(per_tensor_beta2, n, "per_tensor_beta2")
    _per_tensor(per_tensor_beta3, n, "per_tensor_beta3")  # checked; upstream's kernel uses 1 - beta1
    bc = _per_tensor(per_tensor_bias_correction, n, "per_tensor_bias_correction")
    eps = _per_tensor(per_tensor_epsilon, n, "per_tensor_epsilon")
    decay = _per_tensor(per_tensor_decay, n, "per_tensor_decay")
    s = int(_scalar(step, "step"))
    scale = _scalar(global_scale, "global_scale")
    combined = scale
    if float(max_grad_norm) > 0:
        c = float(max_grad_norm) / (_scalar(global_grad_norm, "global_grad_norm") / scale + 1e-6)
        combined = scale / min(1.0, c)
    sg = torch._foreach_div([t.float() for t in g], combined)  # new tensors: g is left as it is
    pf = as_fp32(p)
    if mode == 0:
        torch._foreach_add_(sg, torch._foreach_mul(pf, decay))
    mf, vf = as_fp32(m), as_fp32(v)
    torch._foreach_mul_(mf, b1)
    torch._foreach_add_(mf, torch._foreach_mul(sg, [1.0 - b for b in b1]))
    torch._foreach_mul_(vf, b2)
    torch._foreach_addcmul_(vf, sg, sg, [1.0 - b for b in b2])
    write_back(m, mf)
    write_back(v, vf)
    bc1 = [1.0 - b ** s if on else 1.0 for b, on in zip(b1, bc)]
    bc2 = [1.0 - b ** s if on else 1.0 for b, on in zip(b2, bc)]
    denom = torch._foreach_div(vf, bc2)
    torch._foreach_sqrt_(denom)
    torch._foreach_add_(denom, eps)
    upd = torch._foreach_div(mf, bc1)
    torch._foreach_div_(upd, denom)
    if mode != 0:
        torch._foreach_add_(upd, torch._foreach_mul(pf, decay))
    torch._foreach_copy_(u, upd)


def _to_e5m2(x: torch.Tensor) -> torch.Tensor:
    """Upstream's fp32 -> e5m2 byte: add 1/8 of the value's power of two (sign and exponent bits only),
    round to fp16, keep the high byte."""
    x = x.float()
    pow2 = (x.view(torch.int32) & -8388608).view(torch.float32)  # 0xFF800000
    return ((x + pow2 / 8).half().view(torch.int16) >> 8).to(torch.uint8)


@torch.no_grad()
def multi_tensor_lamb_update_weights(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                     per_tensor_param_norm: torch.Tensor, per_tensor_update_norm: torch.Tensor,
                                     update_norm_offset: torch.Tensor, learning_rate: torch.Tensor,
                                     per_tensor_decay: torch.Tensor, global_grad_norm: torch.Tensor,
                                     use_nvlamb: bool) -> None:
    """``distributed_lamb_cuda.multi_tensor_lamb_update_weights``: ``p -= ratio·u`` with LAMB's trust ratio, then
    the copy into ``p_copy`` (see the module docstring)."""
    device = check_tensor_lists(tensor_lists, 3, list_dtypes={2: (*FLOAT_DTYPES, torch.uint8)})
    check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0] or int(noop_flag.reshape(-1)[0]):
        return
    u, p, p_copy = [list(x) for x in tensor_lists]
    n = len(u)
    decay = _per_tensor(per_tensor_decay, n, "per_tensor_decay")
    offsets = torch.as_tensor(_per_tensor(update_norm_offset, n, "update_norm_offset"), dtype=torch.long)
    pn = per_tensor_param_norm.reshape(-1)[:n].float().cpu()
    un = per_tensor_update_norm.reshape(-1).float().cpu()[offsets]
    lr = _scalar(learning_rate, "learning_rate")
    for trust in (True, False):  # stage 2 decides the trust ratio per call: split by it
        idx = [i for i in range(n) if (bool(use_nvlamb) or decay[i] != 0.0) == trust]
        if idx:
            multi_tensor_lamb_stage2_cuda(chunk_size, noop_flag, [[p[i] for i in idx], [u[i] for i in idx]],
                                          pn[idx].to(device), un[idx].to(device), lr, 1.0 if trust else 0.0, False)
    for dst, src in zip(p_copy, p):
        dst.copy_(_to_e5m2(src) if dst.dtype == torch.uint8 else src)
