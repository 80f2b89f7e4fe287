"""LAMB's CPU path on PyTorch's fused AdamW kernel (``torch._fused_adamw_``), for fp32 parameters and
moments with decoupled weight decay and grad averaging: the rule of ``multi_tensor_lamb``, with no tensor
object created per parameter (see ``_cpu_blocks``)."""

from __future__ import annotations

import torch

from apex.ops import _cpu_blocks


def fusable(g, p, m, v, kw) -> bool:
    """Whether ``torch._fused_adamw_`` computes this step's moments and Adam direction exactly as LAMB
    does: fp32 parameters and moments on the CPU, decoupled decay, grad averaging. It pairs the elements
    of its tensors by memory offset, so the gradients and moments must be contiguous like the
    workspace's buffer."""
    if not (kw["adam_w"] and kw["beta3"] == 1.0 - kw["beta1"] and p[0].is_cpu and g[0].is_cpu):
        return False  # (the lists are on one device: checked, or vouched for by the caller)
    f32 = {torch.float32}
    contiguous = torch.Tensor.is_contiguous
    return ({t.dtype for t in p} == f32 and {t.dtype for t in m} == f32 and {t.dtype for t in v} == f32
            and all(map(contiguous, g)) and all(map(contiguous, m)) and all(map(contiguous, v)))


def _host(x) -> float:
    return float(x.reshape(-1)[0]) if isinstance(x, torch.Tensor) else float(x)


def lamb_fused(noop_flag, g, p, m, v, out, *, workspace, lr, beta1, beta2, eps, step, bias_correction,
               weight_decay, grad_norm, max_grad_norm, use_nvlamb, inv_scale=None, skip_on_noop=False,
               trusted=False, **_) -> None:
    """CPU LAMB block by block (``_cpu_blocks``), each block's tensors smallest first, in a flat fp32
    buffer ``u`` of the workspace: the parameters are copied into it (their norms: one call per run of
    same-sized tensors), scaled by the weight decay, and ``torch._fused_adamw_`` run on it with lr=-1
    adds ``m̂ / (sqrt(v̂) + eps)`` (and updates m and v); then the update norms and
    ``p -= ratio * u`` with the ratios as 0-dim views. No tensor object is created per parameter.
    Scalars are read on the host (cheap on a CPU). fp32 gradients are divided in place by the clip
    factor (and multiplied by ``inv_scale``) when those are not 1 (Apex's kernel overwrites them with the
    update); other gradients are first copied into an fp32 buffer."""
    if skip_on_noop and bool(noop_flag.item()):
        return
    ws = workspace if workspace is not None and (trusted or workspace.fits(p)) else _cpu_blocks.Workspace.of(p)
    layout = ws.layout
    u_flat, u_views = ws.buffer("update")
    g32_views = ws.buffer("grad")[1] if any(t.dtype != torch.float32 for t in g) else None
    ratio, ratio_views = ws.scalars("ratio")
    gn, maxn = _host(grad_norm), _host(max_grad_norm)
    # Apex: ĝ = (g * inv_scale) / clip, i.e. g divided by clip / inv_scale.
    divisor = (gn / maxn if gn > maxn else 1.0) / (_host(inv_scale) if inv_scale is not None else 1.0)
    # Without bias correction: a step so large that beta**step is 0, i.e. corrections of exactly 1.
    step_t = torch.tensor(_host(step) if bias_correction else 2.0 ** 60)
    grad_scale = torch.tensor(divisor) if divisor != 1.0 else None
    lr = _host(lr)
    trust = use_nvlamb or weight_decay != 0.0
    one = torch.ones(())

    def part(blk, g, p, m, v, out):
        k, at = len(blk.order), blk.start
        u = u_flat[blk.offset:blk.offset + blk.numel]
        uv = u_views[at:at + k]
        norms = _cpu_blocks.scratch(2 * k) if trust else None
        if trust:  # (a weight decay implies the trust ratio)
            torch._foreach_copy_(uv, p)
            pn = _cpu_blocks.class_norms(u, blk, norms[k:], views=uv)
        if weight_decay != 0.0:
            u.mul_(weight_decay)
        else:
            u.zero_()
        if g32_views is not None:
            torch._foreach_copy_(g32_views[at:at + k], g)
            g = g32_views[at:at + k]
        # u = wd * p - lr * m̂ / (sqrt(v̂) + eps) with lr = -1
        torch._fused_adamw_(uv, g, m, v, [], [step_t] * k, lr=-1.0, beta1=beta1, beta2=beta2,
                            weight_decay=0.0, eps=eps, amsgrad=False, maximize=False, grad_scale=grad_scale,
                            found_inf=None)
        if trust:
            un = _cpu_blocks.class_norms(u, blk, norms[:k], views=uv)
            r = torch.where((un != 0) & (pn != 0), pn / torch.where(un != 0, un, one), one)
            torch.mul(r, lr, out=ratio[at:at + k])
            torch._foreach_addcmul_(p, uv, ratio_views[at:at + k], value=-1.0)
        else:
            torch._foreach_add_(p, uv, alpha=-lr)
        if out[0] is not None:
            torch._foreach_copy_(out, p)

    none = [None] * len(p)
    # Inference mode skips the autograd dispatch of every per-tensor op (version counters still move);
    # everything the step keeps was made above, outside it.
    with torch.inference_mode():
        _cpu_blocks.run(part, [b.order for b in layout.blocks], g, p, m, v, none if out is None else out,
                        per_part=layout.blocks)


def grads_to_workspace(ws: _cpu_blocks.Workspace, grads: list) -> tuple[list, torch.Tensor]:
    """Copy ``grads`` (any float dtype) into the workspace's fp32 ``"grad"`` buffer and take their norms
    there, block by block on the workers: the fp32 copies (in the gradients' order), which ``lamb_fused``
    then reads without converting again, and the norms (in the layout's order).

    PyTorch's CPU norm of a bf16/fp16 tensor with an fp32 result converts the whole tensor first, which
    costs several times the conversion here; the class norms over the flat copy cost little."""
    flat, views = ws.buffer("grad")
    norms = torch.empty(len(grads), dtype=torch.float32)

    def part(blk, gs):
        at, k = blk.start, len(blk.order)
        vs = views[at:at + k]
        torch._foreach_copy_(vs, gs)
        _cpu_blocks.class_norms(flat[blk.offset:blk.offset + blk.numel], blk, norms[at:at + k], views=vs)

    with torch.inference_mode():
        _cpu_blocks.run(part, [b.order for b in ws.layout.blocks], grads, per_part=ws.layout.blocks)
    return ws.views_in_order("grad"), norms
