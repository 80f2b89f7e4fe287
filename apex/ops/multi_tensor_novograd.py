"""Apex's ``multi_tensor_novograd``: NovoGrad with a per-tensor running gradient norm.

For every tensor ``i`` (fp32 math), with ``n_i`` the L2 norm (``norm_type=2``) or max-norm
(``norm_type=0``) of its gradient::

    norms[i] = sqrt(beta2 * norms[i]^2 + (1 - beta2) * n_i^2)      (norm_type=2)
    norms[i] = beta2 * norms[i] + (1 - beta2) * n_i                 (norm_type=0)
    denom    = norms[i] / bc2 + eps              bc2 = sqrt(1 - beta2**step), bc1 = 1 - beta1**step
    moment_mode 0 (regularisation inside the moment):
        m = beta1 * m + beta3 * (g / denom + weight_decay * p);   p -= lr * m / bc1
    moment_mode 1 (decoupled):
        m = beta1 * m + beta3 * g;   p -= lr * ((m / bc1) / denom + weight_decay * p)

``beta3 = 1 - beta1`` with ``grad_averaging`` else 1; bias corrections are 1 without ``bias_correction``.
``grad_norms`` (fp32, one entry per tensor) is updated in place; ``noop_flag`` is set when a gradient
norm is not finite (the update still runs, as in Apex).
"""

from __future__ import annotations

import math

import torch

from apex import _backend
from apex.ops import _cpu_blocks
from apex.ops._checks import check_noop_flag, check_tensor_lists, first_device, in_param_shapes, mark_found_inf
from apex.ops._cpu_norms import fp32_norms
from apex.ops._cpu_packed import Packed
from apex.ops._fp32 import as_fp32, write_back


def _check_norms(grad_norms, n: int, device) -> None:
    if not isinstance(grad_norms, torch.Tensor) or grad_norms.dtype != torch.float32 or \
            grad_norms.numel() != n or not grad_norms.is_contiguous():
        raise ValueError(f"grad_norms must be a contiguous float32 tensor with one norm per tensor ({n})")
    if grad_norms.device != device:
        raise ValueError(f"grad_norms is on {grad_norms.device} but the tensors are on {device}")


def multi_tensor_novograd(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, grad_norms: torch.Tensor,
                          lr: float, beta1: float, beta2: float, epsilon: float, step: int,
                          bias_correction: int, weight_decay: float, grad_averaging: int, moment_mode: int,
                          norm_type: int, *, workspace: _cpu_blocks.Workspace | None = None,
                          validate: bool = True) -> None:
    """NovoGrad step on ``tensor_lists = [grads, params, exp_avgs]`` (fp32/fp16/bf16). ``validate=False``
    skips the per-tensor checks (for callers, such as apex's optimizers, that have made them and pass
    lists of one dtype each);
    ``workspace`` (apex's addition): a ``_cpu_blocks.Workspace`` for the parameters' shapes that the
    PyTorch path reuses from call to call (with ``validate=False`` the caller vouches that it fits)."""
    if validate:
        from apex._kernels._lists import checked

        tensor_lists = checked("novograd", tensor_lists,
                               lambda: check_tensor_lists(tensor_lists, 3, same_shape=True), shapes=True)
    device = first_device(tensor_lists)
    if validate:
        check_noop_flag(noop_flag, device)
    if norm_type not in (0, 2):
        raise ValueError(f"norm_type must be 0 (max norm) or 2 (L2 norm), got {norm_type!r}")
    if moment_mode not in (0, 1):
        raise ValueError(f"moment_mode must be 0 (regularisation inside the moment) or 1, "
                         f"got {moment_mode!r}")
    if device is None or not tensor_lists[0]:
        return
    g, p, m = tensor_lists  # as given: Columns from an optimizer stay Columns
    _check_norms(grad_norms, len(g), device)
    step = int(step)
    bc1, bc2 = 1.0, 1.0
    if bias_correction:
        bc1 = 1.0 - beta1 ** step
        bc2 = math.sqrt(1.0 - beta2 ** step)
    kw = dict(lr=float(lr), beta1=float(beta1), beta3=1.0 - float(beta1) if grad_averaging else 1.0,
              bc1=bc1, bc2=bc2, eps=float(epsilon), weight_decay=float(weight_decay),
              reg_inside_moment=moment_mode == 0)
    alpha, beta = float(beta2), 1.0 - float(beta2)
    if _backend.select(p) == "triton":
        from apex._kernels import multi_tensor as mt
        from apex._kernels import multi_tensor_novograd as kernels
        from apex._kernels._lists import columns

        g, p, m = columns([g, p, m])
        for idx, (gs, ps, ms) in mt.group([g, p, m]):
            whole = len(idx) == len(g)
            norms = grad_norms if whole else grad_norms[idx].contiguous()
            tab = mt.table([gs, ps, ms])  # (read by both launches)
            kernels.blend_norms(noop_flag, tab, norms, alpha, beta, norm_type == 0)
            kernels.update(tab, norms, **kw)
            if not whole:
                grad_norms[idx] = norms
        empty = [i for i, n in enumerate(g.numels) if n == 0] if 0 in g.numels else None
        if empty:  # no chunks: the blend sees a zero norm
            _blend(grad_norms, empty, torch.zeros(len(empty), device=device), alpha, beta, norm_type)
        return
    g, p, m = list(g) if validate else in_param_shapes(g, p), list(p), list(m)
    if validate and workspace is not None and not workspace.fits(p):
        workspace = None  # (a trusted caller vouches for its workspace)
    # A trusted caller passes lists of one dtype each.
    all32 = None if validate else g[0].dtype == p[0].dtype == m[0].dtype == torch.float32
    with torch.no_grad():  # the PyTorch path writes parameters that require grad
        novograd_torch(noop_flag, g, p, m, grad_norms, alpha=alpha, beta=beta, norm_type=norm_type,
                       workspace=workspace, all32=all32, **kw)


def _blend(norms: torch.Tensor, idx, new: torch.Tensor, alpha: float, beta: float, norm_type: int) -> None:
    norms[idx] = _blended(norms[idx], new, alpha, beta, norm_type)


def _blended(old: torch.Tensor, new: torch.Tensor, alpha: float, beta: float, norm_type: int) -> torch.Tensor:
    if norm_type == 0:
        return alpha * old + beta * new
    return torch.sqrt(alpha * old * old + beta * new * new)


def novograd_torch(noop_flag, g, p, m, grad_norms, *, alpha, beta, norm_type, lr, beta1, beta3, bc1, bc2, eps,
                   weight_decay, reg_inside_moment, workspace: _cpu_blocks.Workspace | None = None,
                   all32: bool | None = None) -> None:
    """The PyTorch path: in-place ``torch._foreach_*`` ops in fp32, with no temporary of the parameters'
    size. Per part of the list: the gradient norms, their blend into ``grad_norms`` and the per-tensor
    factors ``f_i``, written into 0-dim views that the workspace makes once; then::

        decoupled:  m = lerp(m, g, beta3) (or beta1*m + g);  p = p*(1 - lr*wd) - f_i * m,  f_i = lr / (bc1*d_i)
        inside:     m = beta1*m + f_i*g + beta3*wd*p;  p = p - (lr/bc1) * m,              f_i = beta3 / d_i

    When every tensor is fp32 (``all32``; found out when None) and the caller keeps a workspace, the
    small tensors are packed (``_cpu_packed.Packed``): their gradients are copied into a flat buffer,
    normed a class at a time, and, when the moments are the views of the workspace's buffer (as
    ``FusedNovoGrad`` keeps them), their moments are updated by one op; the other tensors are normed and
    updated a cache-sized segment at a time (``_packed``). Otherwise the lists are updated block by
    block, converted to fp32 a block at a time."""
    if all32 is None:
        all32 = {t.dtype for lst in (g, p, m) for t in lst} == {torch.float32}
    ord_ = float("inf") if norm_type == 0 else 2.0
    moment = dict(beta1=beta1, beta3=beta3, reg_inside_moment=reg_inside_moment)
    param = dict(lr=lr, bc1=bc1, beta3=beta3, weight_decay=weight_decay, reg_inside_moment=reg_inside_moment)
    factor = dict(alpha=alpha, beta=beta, norm_type=norm_type, bc2=bc2, eps=eps,
                  scale=beta3 if reg_inside_moment else lr / bc1)
    if all32 and workspace is not None:
        pk = workspace.packed()
        pk.buffer("grad"), pk.scalars("factor")  # made outside inference mode: they are kept
        with torch.inference_mode():
            _packed(noop_flag, g, p, m, grad_norms, pk, ord_=ord_, moment=moment, param=param, factor=factor)
        return
    ws = workspace if workspace is not None else _cpu_blocks.Workspace.of(p)
    factors, factor_views = ws.scalars("factor")
    perm = ws.perm_index()  # a block's tensors are perm[blk.start:blk.start + len(blk.order)]
    new = torch.empty(len(g), dtype=torch.float32)  # this step's norms, in layout order

    def part(blk, g, p, m):
        # A tensor's factor needs only its own norm: each block is normed (from its fp32 copies, which
        # is cheaper than PyTorch's fp32 norm of a bf16/fp16 tensor) and updated in turn.
        lo, hi = blk.start, blk.start + len(blk.order)
        gf, pf, mf = (g, p, m) if all32 else (as_fp32(g), as_fp32(p), as_fp32(m))
        new[lo:hi] = fp32_norms(gf, ord_)
        _blend_factors(grad_norms, perm[lo:hi], new[lo:hi], factors[lo:hi], **factor)
        _moment(gf, mf, factor_views[lo:hi], **moment)
        _param(pf, mf, factor_views[lo:hi], **param)
        if not all32:
            write_back(p, pf)
            write_back(m, mf)

    # The update only streams memory: a second core adds no bandwidth, so no worker threads.
    _cpu_blocks.run(part, [b.order for b in ws.layout.blocks], g, p, m, per_part=ws.layout.blocks,
                    threads=False)
    mark_found_inf(noop_flag, (~torch.isfinite(new)).any())  # Apex flags it but still updates


def _blend_factors(grad_norms, index, new, factors, *, alpha, beta, norm_type, bc2, eps, scale) -> None:
    """Blend this step's norms ``new`` of the tensors ``index`` into ``grad_norms``; their factors
    ``f_i = scale / d_i`` into ``factors`` (both in the order of ``index``)."""
    norms = _blended(grad_norms.index_select(0, index), new, alpha, beta, norm_type)
    grad_norms.index_copy_(0, index, norms)
    torch.div(scale, norms / bc2 + eps, out=factors)


def _moment(g, m, fv, *, beta1, beta3, reg_inside_moment) -> None:
    """The moment update of fp32 lists (without the weight decay of ``reg_inside_moment``)."""
    if reg_inside_moment:
        torch._foreach_mul_(m, beta1)
        torch._foreach_addcmul_(m, g, fv)
    elif beta3 == 1.0 - beta1:
        torch._foreach_lerp_(m, g, beta3)
    else:
        torch._foreach_mul_(m, beta1)
        torch._foreach_add_(m, g, alpha=beta3)


def _param(p, m, fv, *, lr, bc1, beta3, weight_decay, reg_inside_moment) -> None:
    """The parameter update of fp32 lists, after ``_moment``."""
    if reg_inside_moment:
        if weight_decay != 0.0:
            torch._foreach_add_(m, p, alpha=beta3 * weight_decay)
        torch._foreach_add_(p, m, alpha=-lr / bc1)
    else:
        if weight_decay != 0.0:
            torch._foreach_mul_(p, 1.0 - lr * weight_decay)
        torch._foreach_addcmul_(p, m, fv, value=-1.0)


def _packed(noop_flag, g, p, m, grad_norms, pk: Packed, *, ord_, moment, param, factor) -> None:
    """The fp32 path over a ``Packed`` layout (see ``novograd_torch``), one segment at a time: a tensor's
    factor needs only its own norm, so each segment is normed and updated while it is in the cache."""
    factors, fv = pk.scalars("factor")
    new = torch.empty(len(g), dtype=torch.float32)  # this step's norms, in perm order
    for seg in pk.segments:
        lo, hi = seg.start, seg.stop
        gs, ps, ms = seg.take(g), seg.take(p), seg.take(m)
        packed = lo == 0 and pk.index
        if packed:
            flat_g, g_views = pk.buffer("grad")
            torch._foreach_copy_(g_views, gs)
            _cpu_blocks.class_norms(flat_g, pk.block, new[lo:hi], ord_, views=g_views)
        else:
            new[lo:hi] = fp32_norms(gs, ord_)
        _blend_factors(grad_norms, seg.index, new[lo:hi], factors[lo:hi], **factor)
        if packed and pk.holds("exp_avg", ms):
            flat_m = pk.buffer("exp_avg")[0]
            if moment["reg_inside_moment"]:  # per-tensor factors: one op per class of same-sized tensors
                flat_m.mul_(moment["beta1"])
                for j, c, n, at in pk.block.classes:
                    flat_m[at:at + c * n].view(c, n).addcmul_(flat_g[at:at + c * n].view(c, n),
                                                            factors[j:j + c, None])
            else:
                _moment([flat_g], [flat_m], None, **moment)
        else:
            _moment(g_views if packed else gs, ms, fv[lo:hi], **moment)
        _param(ps, ms, fv[lo:hi], **param)
    mark_found_inf(noop_flag, (~torch.isfinite(new)).any())  # Apex flags it but still updates
