"""LAMB over lists of tensors: Adam-style moments, then a per-tensor trust ratio.

Passes per (device, dtype) group, with the global gradient norm already computed by the caller:

* trust ratio off (``weight_decay == 0`` and not nvlamb): one launch reads g, p, m, v and writes p, m, v
  (the minimum traffic);
* trust ratio on: the moments launch reads g, m, v, p, writes m, v and one partial sum of the update's
  and of the parameter's squares per chunk; a small launch reduces the partials to per-tensor norms; the
  apply launch reads m, v, p, recomputes the (bit-identical) update from the stored moments and writes p.
  The update is never stored, so the gradients are left untouched (Apex's kernel overwrites them).

Math in IEEE fp32 for every storage dtype (``tl.div_rn``/``tl.sqrt_rn``: Triton's ``/`` and ``tl.sqrt``
are approximate on NVIDIA GPUs); ``1 - beta`` comes from the host in double; bias corrections of a
device-side ``step`` are computed in fp64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt
from apex._kernels._chunk_reduce import reduce_rows


@triton.jit
def _pow_int(base, s):
    """``base ** s`` in fp64 by repeated squaring (s: a non-negative int32 < 2**31)."""
    r = tl.full([], 1.0, tl.float64)
    b = base.to(tl.float64)
    for _ in range(0, 31):
        r = tl.where((s & 1) != 0, r * b, r)
        b = b * b
        s = s >> 1
    return r


@triton.jit
def _scalars(noop_flag, grad_norm, max_norm, max_norm_ptr, lr, lr_ptr, bc1, bc2, step_ptr, betas64,
             SKIP: tl.constexpr, MAXN_PTR: tl.constexpr, LR_PTR: tl.constexpr, STEP_PTR: tl.constexpr,
             BIAS_CORR: tl.constexpr):
    live = 1
    if SKIP:
        live = (tl.load(noop_flag) == 0).to(tl.int32)
    gn = tl.load(grad_norm).to(tl.float32)
    if MAXN_PTR:
        mx = tl.load(max_norm_ptr).to(tl.float32)
    else:
        mx = max_norm
    clip = tl.where(gn > mx, tl.div_rn(gn, mx), 1.0)
    if LR_PTR:
        lr = tl.load(lr_ptr).to(tl.float32)
    if STEP_PTR:
        if BIAS_CORR:
            s = tl.load(step_ptr).to(tl.int32)
            bc1 = (1.0 - _pow_int(tl.load(betas64), s)).to(tl.float32)
            bc2 = (1.0 - _pow_int(tl.load(betas64 + 1), s)).to(tl.float32)
    return live, clip, lr, bc1, bc2


@triton.jit
def _direction(m, v, p, bc1, bc2, eps, decay, ADAM_W: tl.constexpr):
    u = tl.div_rn(tl.div_rn(m, bc1), tl.sqrt_rn(tl.div_rn(v, bc2)) + eps)
    if ADAM_W:
        u = u + decay * p
    return u


@triton.jit
def _moments_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors,
                    partials, n_chunks, noop_flag, grad_norm, max_norm, max_norm_ptr, inv_scale,
                    lr, lr_ptr, bc1, bc2, step_ptr, betas64,
                    beta1, beta2, beta3, one_m_b2, eps, decay,
                    G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                    O_DT: tl.constexpr, ADAM_W: tl.constexpr, NEED_P: tl.constexpr, TRUST: tl.constexpr,
                    HAS_OUT: tl.constexpr, SKIP: tl.constexpr, HAS_SCALE: tl.constexpr,
                    MAXN_PTR: tl.constexpr, LR_PTR: tl.constexpr, STEP_PTR: tl.constexpr,
                    BIAS_CORR: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # (ALIGNED: the table's ``aligned``, 4-element vector accesses; see mt.tensor_ptr)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED)
    live, clip, lr, bc1, bc2 = _scalars(noop_flag, grad_norm, max_norm, max_norm_ptr, lr, lr_ptr, bc1, bc2,
                                        step_ptr, betas64, SKIP, MAXN_PTR, LR_PTR, STEP_PTR, BIAS_CORR)
    n = n * live  # a skipped step touches no memory
    g_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED)
    p_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, P_DT, ALIGNED)
    m_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, M_DT, ALIGNED)
    v_ptr = mt.tensor_ptr(ptrs, 3, n_tensors, t, V_DT, ALIGNED)
    o_ptr = mt.tensor_ptr(ptrs, 4, n_tensors, t, O_DT, ALIGNED)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(inv_scale).to(tl.float32)
    acc_u = tl.zeros([BLOCK], dtype=tl.float32)
    acc_p = tl.zeros([BLOCK], dtype=tl.float32)
    for off in range(0, CHUNK, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = g * scale
        p = tl.zeros([BLOCK], dtype=tl.float32)
        if NEED_P:
            p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        sg = tl.div_rn(g, clip)
        if not ADAM_W:
            sg = sg + decay * p
        m = m * beta1 + beta3 * sg
        v = v * beta2 + one_m_b2 * sg * sg
        m_s = m.to(M_DT)
        v_s = v.to(V_DT)
        tl.store(m_ptr + idx, m_s, mask=mask)
        tl.store(v_ptr + idx, v_s, mask=mask)
        if TRUST:
            # The apply pass recomputes the update from the stored moments: use the same values here.
            u = _direction(m_s.to(tl.float32), v_s.to(tl.float32), p, bc1, bc2, eps, decay, ADAM_W)
            acc_u += tl.where(mask, u * u, 0.0)
            acc_p += p * p
        else:
            if not NEED_P:
                p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
            u = _direction(m, v, p, bc1, bc2, eps, decay, ADAM_W)
            p = p - lr * u
            tl.store(p_ptr + idx, p.to(P_DT), mask=mask)
            if HAS_OUT:
                tl.store(o_ptr + idx, p.to(O_DT), mask=mask)
    if TRUST:
        pid = tl.program_id(0)
        tl.store(partials + pid, tl.sum(acc_u, axis=0))
        tl.store(partials + n_chunks + pid, tl.sum(acc_p, axis=0))


@triton.jit
def _apply_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors,
                  norms, noop_flag, grad_norm, max_norm, max_norm_ptr,
                  lr, lr_ptr, bc1, bc2, step_ptr, betas64, eps, decay,
                  G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                  O_DT: tl.constexpr,
                  ADAM_W: tl.constexpr, HAS_OUT: tl.constexpr, SKIP: tl.constexpr,
                  MAXN_PTR: tl.constexpr, LR_PTR: tl.constexpr, STEP_PTR: tl.constexpr,
                  BIAS_CORR: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                  PARTS: tl.constexpr = 1):
    # (ALIGNED: the table's ``rest_aligned``: the gradients' list 0, which alone moves from step to step, is
    # not read here)
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    live, clip, lr, bc1, bc2 = _scalars(noop_flag, grad_norm, max_norm, max_norm_ptr, lr, lr_ptr, bc1, bc2,
                                        step_ptr, betas64, SKIP, MAXN_PTR, LR_PTR, STEP_PTR, BIAS_CORR)
    n = n * live  # a skipped step touches no memory
    u_norm = tl.load(norms + t)
    p_norm = tl.load(norms + n_tensors + t)
    safe = tl.where(u_norm != 0.0, u_norm, 1.0)  # both branches are evaluated: avoid 0/0
    ratio = tl.where((u_norm != 0.0) & (p_norm != 0.0), lr * tl.div_rn(p_norm, safe), lr)
    # (the moments launch's table [g, p, m, v, out]: the gradients' list is not read)
    p_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, P_DT, ALIGNED)
    m_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, M_DT, ALIGNED)
    v_ptr = mt.tensor_ptr(ptrs, 3, n_tensors, t, V_DT, ALIGNED)
    o_ptr = mt.tensor_ptr(ptrs, 4, n_tensors, t, O_DT, ALIGNED)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = p - ratio * _direction(m, v, p, bc1, bc2, eps, decay, ADAM_W)
        tl.store(p_ptr + idx, p.to(P_DT), mask=mask)
        if HAS_OUT:
            tl.store(o_ptr + idx, p.to(O_DT), mask=mask)


# Names in apex._kernels._tuning of the element-wise kernels, which mt.parts may split a chunk over programs
# (the moments kernel writes one partial sum a program, indexed by program id: one program a chunk).
APPLY_OP, STAGE1_OP, STAGE2_OP = "multi_tensor_lamb.apply", "multi_tensor_lamb.stage1", "multi_tensor_lamb.stage2"
_betas_cache: dict = {}


def _betas64(beta1: float, beta2: float, device) -> torch.Tensor:
    key = (float(beta1), float(beta2), device)
    t = _betas_cache.get(key)
    if t is None:
        if len(_betas_cache) > 32:
            _betas_cache.clear()
        t = torch.tensor([beta1, beta2], dtype=torch.float64).to(device)
        _betas_cache[key] = t
    return t


def tables(g: list, p: list, m: list, v: list, out: list | None) -> list:
    """The device tables of one LAMB call, one per (device, dtypes) group of ``[g, p, m, v, out or p]``:
    every launch of the step reads its tensors through them (the global norm's partials list 0, the
    moments and apply launches all five), so new gradients cost one table."""
    return [mt.table(sub) for _, sub in mt.group([g, p, m, v, out if out is not None else p])]


def lamb(noop_flag: torch.Tensor, g: list, p: list, m: list, v: list, out: list | None, **kw) -> None:
    """One LAMB step. ``lr``, ``step`` and ``max_grad_norm`` are Python numbers or one-element device
    tensors; ``out`` (optional) receives a reduced-precision copy of the updated ``p``."""
    lamb_on(noop_flag, tables(g, p, m, v, out), has_out=out is not None, **kw)


def lamb_on(noop_flag: torch.Tensor, tabs: list, *, has_out: bool, lr, beta1: float, beta2: float, eps: float,
            step, bias_correction: bool, weight_decay: float, beta3: float, adam_w: bool,
            grad_norm: torch.Tensor, max_grad_norm, use_nvlamb: bool, inv_scale: torch.Tensor | None = None,
            skip_on_noop: bool = False, scratch: dict | None = None) -> None:
    """:func:`lamb` on the :func:`tables` of its lists. ``scratch``: a dict the caller keeps from step to step
    for the partial sums and norms (stream-ordered reuse), instead of two allocations per table."""
    if not tabs:
        return
    device = tabs[0].ptrs.device
    lr_ptr = lr if isinstance(lr, torch.Tensor) else None
    step_ptr = step if isinstance(step, torch.Tensor) else None
    maxn_ptr = max_grad_norm if isinstance(max_grad_norm, torch.Tensor) else None
    lr_f = 0.0 if lr_ptr is not None else float(lr)
    maxn_f = 0.0 if maxn_ptr is not None else float(max_grad_norm)
    bc1 = bc2 = 1.0
    if bias_correction and step_ptr is None:
        bc1, bc2 = 1.0 - beta1 ** int(step), 1.0 - beta2 ** int(step)
    betas = _betas64(beta1, beta2, device) if step_ptr is not None else grad_norm
    trust = bool(use_nvlamb) or weight_decay != 0.0
    # (constexprs by position, in the kernels' order)
    adam_w, has_out, skip = bool(adam_w), bool(has_out), bool(skip_on_noop)
    ptrs = (maxn_ptr is not None, lr_ptr is not None, step_ptr is not None, bool(bias_correction))
    maxn_arg = maxn_ptr if maxn_ptr is not None else grad_norm
    lr_arg = lr_ptr if lr_ptr is not None else grad_norm
    step_arg = step_ptr if step_ptr is not None else noop_flag
    eps, decay = float(eps), float(weight_decay)
    for tab in tabs:
        partials = _buffer(scratch, "partials", 2 * tab.n_chunks if trust else 1, device)
        mt.launch(_moments_kernel, tab, partials, tab.n_chunks, noop_flag, grad_norm, maxn_f, maxn_arg,
                  inv_scale if inv_scale is not None else grad_norm, lr_f, lr_arg, bc1, bc2, step_arg, betas,
                  float(beta1), float(beta2), float(beta3), 1.0 - float(beta2), eps, decay,
                  options=(adam_w, trust or decay != 0.0, trust, has_out, skip, inv_scale is not None) + ptrs
                  + (tab.aligned,))
        if not trust:
            continue
        norms = _buffer(scratch, "norms", 2 * tab.n_tensors, device)
        reduce_rows(partials, tab, norms, 2)
        mt.launch(_apply_kernel, tab, norms, noop_flag, grad_norm, maxn_f, maxn_arg, lr_f, lr_arg, bc1, bc2,
                  step_arg, betas, eps, decay, options=(adam_w, has_out, skip) + ptrs + (tab.rest_aligned,),
                  op=APPLY_OP)


def _buffer(scratch: dict | None, name: str, n: int, device: torch.device) -> torch.Tensor:
    """An fp32 buffer of at least ``n`` elements, kept in ``scratch`` (None: a new one)."""
    if scratch is None:
        return torch.empty(n, dtype=torch.float32, device=device)
    key = (name, device)
    buf = scratch.get(key)
    if buf is None or buf.numel() < n:
        buf = scratch[key] = torch.empty(n, dtype=torch.float32, device=device)
    return buf


@triton.jit
def _stage1_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, decays, grad_norm, max_norm,
                   beta1, beta2, one_m_b1, one_m_b2, bc1, bc2, eps,
                   G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                   U_DT: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                   PARTS: tl.constexpr = 1):
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    gn = tl.load(grad_norm).to(tl.float32)
    clip = tl.where(gn > max_norm, tl.div_rn(gn, max_norm), 1.0)
    decay = tl.load(decays + t).to(tl.float32)
    g_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED)
    p_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, P_DT, ALIGNED)
    m_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, M_DT, ALIGNED)
    v_ptr = mt.tensor_ptr(ptrs, 3, n_tensors, t, V_DT, ALIGNED)
    u_ptr = mt.tensor_ptr(ptrs, 4, n_tensors, t, U_DT, ALIGNED)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        sg = tl.div_rn(tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32), clip)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32) * beta1 + one_m_b1 * sg
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32) * beta2 + one_m_b2 * sg * sg
        u = _direction(m, v, p, bc1, bc2, eps, decay, True)
        tl.store(m_ptr + idx, m.to(M_DT), mask=mask)
        tl.store(v_ptr + idx, v.to(V_DT), mask=mask)
        tl.store(u_ptr + idx, u.to(U_DT), mask=mask)


@triton.jit
def _stage2_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, p_norms, u_norms, lr,
                   P_DT: tl.constexpr, U_DT: tl.constexpr, TRUST: tl.constexpr, ALIGNED: tl.constexpr,
                   CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr = 1):
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    ratio = lr
    if TRUST:
        pn = tl.load(p_norms + t).to(tl.float32)
        un = tl.load(u_norms + t).to(tl.float32)
        ratio = tl.where((un != 0.0) & (pn != 0.0), lr * tl.div_rn(pn, tl.where(un != 0.0, un, 1.0)), lr)
    p_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, P_DT, ALIGNED)
    u_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, U_DT, ALIGNED)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(p_ptr + idx, (p - ratio * u).to(P_DT), mask=mask)


def stage1(lists: list, decays: torch.Tensor, grad_norm: torch.Tensor, max_norm: float, beta1: float,
           beta2: float, bc1: float, bc2: float, eps: float) -> None:
    """Apex's LAMB stage 1 on ``[g, p, m, v, update]``; ``decays``: fp32, one weight decay per tensor."""
    n = len(lists[0])
    for idx, subs in mt.group(lists):
        sel = decays if len(idx) == n else decays.index_select(0, mt.index_on(idx, decays.device))
        tab = mt.table(subs)
        mt.launch(_stage1_kernel, tab, sel.contiguous(), grad_norm, float(max_norm), float(beta1),
                  float(beta2), 1.0 - float(beta1), 1.0 - float(beta2), float(bc1), float(bc2), float(eps),
                  options=(tab.aligned,), op=STAGE1_OP)


def stage2(lists: list, p_norms: torch.Tensor, u_norms: torch.Tensor, lr: float, trust: bool) -> None:
    """Apex's LAMB stage 2 on ``[p, update]`` with per-tensor norms (fp32)."""
    n = len(lists[0])
    for idx, subs in mt.group(lists):
        if len(idx) == n:  # one group of every tensor
            pn, un = p_norms, u_norms
        else:  # this group's tensors' norms, in order (gathered with an index uploaded once)
            at = mt.index_on(idx, p_norms.device)
            pn, un = p_norms.index_select(0, at), u_norms.index_select(0, at)
        tab = mt.table(subs)
        mt.launch(_stage2_kernel, tab, pn, un, float(lr), options=(bool(trust), tab.aligned), op=STAGE2_OP,
                  default_parts=1)
