"""OpenFold's triangle/MSA attention with a 0/1 key mask and an additive bias: flash-attention kernels.

``o = softmax(q·kᵀ/√d + (mask − 1)·inf + bias) · v`` over ``[Z, H, NQ, D]`` queries and ``[Z, H, NK, D]``
keys/values, with ``mask`` and ``bias`` read through broadcast strides (a stride of 0 repeats them, so
OpenFold's ``[B, 1, 1, NK]`` mask and ``[1, H, NQ, NK]`` bias are never expanded in memory).

Forward keeps a running max and sum per query row and writes ``o`` and the fp32 log-sum-exp. Backward has
two kernels, no atomics: one per query block writes ``delta = Σ o·do``, ``dq`` and (when the bias needs a
gradient) the fp32 score gradient ``ds`` per ``[Z, H, NQ, NK]``, which the op layer sums over the bias's
broadcast dimensions; one per key block accumulates ``dk`` and ``dv``. Scores and accumulators are fp32.
On GPUs the two products use the input dtype (fp16/bf16 tensor cores, fp32 accumulation) and
``input_precision="ieee"`` for fp32 inputs; under the interpreter every product is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _mm(a, b, LOW: tl.constexpr, DT: tl.constexpr):
    if LOW:
        return tl.dot(a.to(DT), b.to(DT))
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_mm)
_F32 = torch.float32


@triton.jit
def _scores(qt, kb, mask_base, bias_base, offs_m, offs_n, NQ, NK, sm_m, sm_n, sb_m, sb_n, scale, inf,
            HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, LOW: tl.constexpr, DT: tl.constexpr):
    """fp32 scores ``[BLOCK_M, BLOCK_N]`` of queries ``qt`` against one key block ``kb`` ``[BLOCK_N, BLOCK_D]``;
    keys past ``NK`` get −inf."""
    nmask = offs_n < NK
    s = _mm(qt, tl.trans(kb), LOW, DT) * scale
    both = (offs_m[:, None] < NQ) & nmask[None, :]
    if HAS_MASK:
        mk = tl.load(mask_base + offs_m[:, None] * sm_m + offs_n[None, :] * sm_n, mask=both, other=1.0)
        s += (mk.to(tl.float32) - 1.0) * inf
    if HAS_BIAS:
        s += tl.load(bias_base + offs_m[:, None] * sb_m + offs_n[None, :] * sb_n, mask=both,
                     other=0.0).to(tl.float32)
    return tl.where(nmask[None, :], s, float("-inf"))


@triton.jit
def _attn_fwd(q, k, v, mask, bias, o, lse,
              sq_z, sq_h, sq_m, sq_d, sk_z, sk_h, sk_n, sk_d, sv_z, sv_h, sv_n, sv_d,
              sm_z, sm_h, sm_m, sm_n, sb_z, sb_h, sb_m, sb_n,
              H, NQ, NK, D, scale, inf, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, LOW: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    zh = tl.program_id(1)
    z = (zh // H).to(tl.int64)
    h = (zh % H).to(tl.int64)
    DT = q.dtype.element_ty
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mrow = offs_m < NQ
    dmask = offs_d < D
    qt = tl.load(q + z * sq_z + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d,
                 mask=mrow[:, None] & dmask[None, :], other=0.0)
    k_base = k + z * sk_z + h * sk_h
    v_base = v + z * sv_z + h * sv_h
    mask_base = mask + z * sm_z + h * sm_h
    bias_base = bias + z * sb_z + h * sb_h
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        kb = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d,
                     mask=(offs_n[:, None] < NK) & dmask[None, :], other=0.0)
        s = _scores(qt, kb, mask_base, bias_base, offs_m, offs_n, NQ, NK, sm_m, sm_n, sb_m, sb_n, scale, inf,
                    HAS_MASK, HAS_BIAS, LOW, DT)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        vt = tl.load(v_base + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d,
                     mask=(offs_n[:, None] < NK) & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + _mm(p, vt, LOW, DT)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    o_off = (zh.to(tl.int64) * NQ + offs_m)[:, None] * D + offs_d[None, :]
    tl.store(o + o_off, out.to(o.dtype.element_ty), mask=mrow[:, None] & dmask[None, :])
    tl.store(lse + zh.to(tl.int64) * NQ + offs_m, m_i + tl.log(l_i), mask=mrow)


@triton.jit
def _attn_bwd_dq(q, k, v, mask, bias, o, do, lse, delta, dq, ds,
                 sq_z, sq_h, sq_m, sq_d, sk_z, sk_h, sk_n, sk_d, sv_z, sv_h, sv_n, sv_d,
                 sm_z, sm_h, sm_m, sm_n, sb_z, sb_h, sb_m, sb_n,
                 H, NQ, NK, D, scale, inf, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, NEED_DS: tl.constexpr,
                 LOW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    zh = tl.program_id(1)
    z = (zh // H).to(tl.int64)
    h = (zh % H).to(tl.int64)
    DT = q.dtype.element_ty
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    mrow = offs_m < NQ
    md = mrow[:, None] & (offs_d[None, :] < D)
    qt = tl.load(q + z * sq_z + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d, mask=md, other=0.0)
    row = zh.to(tl.int64) * NQ + offs_m
    o_off = row[:, None] * D + offs_d[None, :]
    dot_ = tl.load(do + o_off, mask=md, other=0.0)
    dl = tl.sum(tl.load(o + o_off, mask=md, other=0.0).to(tl.float32) * dot_.to(tl.float32), axis=1)
    tl.store(delta + row, dl, mask=mrow)
    lse_i = tl.load(lse + row, mask=mrow, other=0.0)
    k_base = k + z * sk_z + h * sk_h
    v_base = v + z * sv_z + h * sv_h
    mask_base = mask + z * sm_z + h * sm_h
    bias_base = bias + z * sb_z + h * sb_h
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, NK, BLOCK_N):
        offs_n = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        nmask = offs_n < NK
        kb = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d,
                     mask=nmask[:, None] & (offs_d[None, :] < D), other=0.0)
        s = _scores(qt, kb, mask_base, bias_base, offs_m, offs_n, NQ, NK, sm_m, sm_n, sb_m, sb_n, scale, inf,
                    HAS_MASK, HAS_BIAS, LOW, DT)
        both = mrow[:, None] & nmask[None, :]
        p = tl.where(both, tl.exp(s - lse_i[:, None]), 0.0)
        vt = tl.load(v_base + offs_n[None, :] * sv_n + offs_d[:, None] * sv_d,
                     mask=nmask[None, :] & (offs_d[:, None] < D), other=0.0)
        dp = _mm(dot_, vt, LOW, DT)
        dsb = p * (dp - dl[:, None])
        if NEED_DS:
            tl.store(ds + row[:, None] * NK + offs_n[None, :], dsb, mask=both)
        acc += _mm(dsb, kb, LOW, DT)
    tl.store(dq + o_off, (acc * scale).to(dq.dtype.element_ty), mask=md)


@triton.jit
def _attn_bwd_dkdv(q, k, v, mask, bias, do, lse, delta, dk, dv,
                   sq_z, sq_h, sq_m, sq_d, sk_z, sk_h, sk_n, sk_d, sv_z, sv_h, sv_n, sv_d,
                   sm_z, sm_h, sm_m, sm_n, sb_z, sb_h, sb_m, sb_n,
                   H, NQ, NK, D, scale, inf, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, LOW: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    zh = tl.program_id(1)
    z = (zh // H).to(tl.int64)
    h = (zh % H).to(tl.int64)
    DT = q.dtype.element_ty
    offs_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    nmask = offs_n < NK
    dmask = offs_d < D
    nd = nmask[:, None] & dmask[None, :]
    vb = tl.load(v + z * sv_z + h * sv_h + offs_n[:, None] * sv_n + offs_d[None, :] * sv_d, mask=nd, other=0.0)
    kb = tl.load(k + z * sk_z + h * sk_h + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d, mask=nd, other=0.0)
    mask_base = mask + z * sm_z + h * sm_h
    bias_base = bias + z * sb_z + h * sb_h
    dk_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for m0 in range(0, NQ, BLOCK_M):
        offs_m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        mrow = offs_m < NQ
        md = mrow[:, None] & dmask[None, :]
        qt = tl.load(q + z * sq_z + h * sq_h + offs_m[:, None] * sq_m + offs_d[None, :] * sq_d, mask=md, other=0.0)
        s = _scores(qt, kb, mask_base, bias_base, offs_m, offs_n, NQ, NK, sm_m, sm_n, sb_m, sb_n, scale, inf,
                    HAS_MASK, HAS_BIAS, LOW, DT)
        row = zh.to(tl.int64) * NQ + offs_m
        lse_i = tl.load(lse + row, mask=mrow, other=0.0)
        dl = tl.load(delta + row, mask=mrow, other=0.0)
        p = tl.where(mrow[:, None] & nmask[None, :], tl.exp(s - lse_i[:, None]), 0.0)
        dot_ = tl.load(do + row[:, None] * D + offs_d[None, :], mask=md, other=0.0)
        dv_acc += _mm(tl.trans(p), dot_, LOW, DT)
        dp = _mm(dot_, tl.trans(vb), LOW, DT)
        dsb = p * (dp - dl[:, None])
        dk_acc += _mm(tl.trans(dsb), qt, LOW, DT)
    kv_off = (zh.to(tl.int64) * NK + offs_n)[:, None] * D + offs_d[None, :]
    tl.store(dk + kv_off, (dk_acc * scale).to(dk.dtype.element_ty), mask=nd)
    tl.store(dv + kv_off, dv_acc.to(dv.dtype.element_ty), mask=nd)


def _blocks(d: int, device: torch.device) -> tuple[int, int, int]:
    # Every GPU launch takes Triton's default of 4 warps (the interpreter none): no num_warps keyword, which
    # would cost each launch ~2,000 instructions. A configuration wanting other warps must pass it again.
    block_d = max(16, next_power_of_2(d))
    if _INTERP or device.type != "cuda":
        return 32, 64, block_d  # the interpreter pays per op: few, large blocks
    if block_d <= 64:
        return 64, 64, block_d
    return 64, 32, block_d


# Launch plans by (Z, H, NQ, NK, D, dtype, on CUDA): blocks, the low-precision flag and the launchers of
# the forward and the two backward kernels on their grids; a call of a geometry seen before looks them up.
_PLANS = _tuning.plan_cache()


def _plan(dims: tuple, q: torch.Tensor) -> tuple:
    dtype, on_cuda = q.dtype, q.is_cuda
    key = (*dims, dtype, on_cuda)
    plan = _PLANS.get(key)
    if plan is None:
        z, h, nq, nk, d = dims
        bm, bn, bd = _blocks(d, q.device)
        low = dtype in (torch.float16, torch.bfloat16) and not _INTERP
        grid_q, grid_k = (cdiv(nq, bm), z * h), (cdiv(nk, bn), z * h)
        # The grids' launchers kept with the plan: kernel[grid] builds a new one at every call.
        plan = _PLANS[key] = (bm, bn, bd, low, _attn_fwd[grid_q], _attn_bwd_dq[grid_q],
                              _attn_bwd_dkdv[grid_k])
    return plan


def forward(q, k, v, mask, bias, scale: float, inf: float, dims: tuple, strides: tuple):
    """``(o, lse)``: ``q``/``k``/``v`` read as ``[Z, H, N, D]`` and ``mask``/``bias`` (None or broadcast) as
    ``[Z, H, NQ, NK]`` through ``strides`` (their 20 strides in that order, 0 for an absent one), ``dims`` =
    ``(Z, H, NQ, NK, D)``. ``o`` contiguous in ``q``'s shape and dtype, ``lse`` fp32 ``[Z, H, NQ]``."""
    z, h, nq, nk, d = dims
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    # (new_empty with integer sizes: no device object, ~1.5k instructions less than torch.empty(..., device=); no
    # dtype keyword where q's is the answer: each keyword costs an allocation ~2,000 instructions to parse)
    lse = q.new_empty(z, h, nq) if q.dtype is _F32 else q.new_empty(z, h, nq, dtype=_F32)
    if z == 0 or h == 0 or nq == 0 or d == 0:
        return o, lse
    launch_forward(_plan(dims, q), q, k, v, mask, bias, o, lse, float(scale), float(inf), dims, strides)
    return o, lse


# The launches, written once: this module's launchers and apex.ops._openfold_attention_direct (which keeps an
# argument layout's dims, strides and plan) both launch through these, with the same arguments (the same bits).
def launch_forward(plan: tuple, q, k, v, mask, bias, o, lse, scale: float, inf: float, dims: tuple,
                   strides: tuple) -> None:
    """The forward launch of :func:`_plan`'s ``plan`` into the caller's ``o`` and ``lse`` (see :func:`forward`;
    ``scale`` and ``inf`` Python floats)."""
    bm, bn, bd, low, launch, _, _ = plan
    # The constexprs positionally (HAS_MASK, HAS_BIAS, LOW, BLOCK_M, BLOCK_N, BLOCK_D) and no launch options
    # (see _blocks): each keyword costs a launch ~2,000 instructions of dictionary building and binding.
    launch(
        q, k, v, mask if mask is not None else q, bias if bias is not None else q, o, lse, *strides, dims[1], dims[2],
        dims[3], dims[4], scale, inf, mask is not None, bias is not None, low, bm, bn, bd)


def backward(do, q, k, v, mask, bias, o, lse, scale: float, inf: float, need_ds: bool, dims: tuple,
             strides: tuple):
    """``(dq, dk, dv, ds)``: contiguous gradients in the inputs' shapes and dtypes; ``ds`` the fp32 score
    gradient ``[Z, H, NQ, NK]`` when ``need_ds``, else None. ``do`` and ``o`` contiguous; ``dims`` and
    ``strides`` as :func:`forward`'s."""
    z, h, nq, nk, d = dims
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    dk = torch.empty_like(k, memory_format=torch.contiguous_format)
    dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    f32 = q.dtype is _F32
    ds = (q.new_empty(z, h, nq, nk) if f32 else q.new_empty(z, h, nq, nk, dtype=_F32)) if need_ds else None
    delta = q.new_empty(z, h, nq) if f32 else q.new_empty(z, h, nq, dtype=_F32)
    if z == 0 or h == 0 or nq == 0 or nk == 0 or d == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), ds.zero_() if ds is not None else None
    launch_backward(_plan(dims, q), do, q, k, v, mask, bias, o, lse, float(scale), float(inf), need_ds, dims, strides,
                    dq, dk, dv, ds, delta)
    return dq, dk, dv, ds


def launch_backward(plan: tuple, do, q, k, v, mask, bias, o, lse, scale: float, inf: float, need_ds: bool,
                    dims: tuple, strides: tuple, dq, dk, dv, ds, delta) -> None:
    """The backward's two launches of :func:`_plan`'s ``plan`` into the caller's ``dq``, ``dk``, ``dv``, ``ds``
    (None unless ``need_ds``) and ``delta`` (see :func:`backward`; ``scale`` and ``inf`` Python floats)."""
    bm, bn, bd, low, _, launch_dq, launch_dkdv = plan
    h, nq, nk, d = dims[1], dims[2], dims[3], dims[4]
    m_arg = mask if mask is not None else q
    b_arg = bias if bias is not None else q
    has_mask, has_bias = mask is not None, bias is not None
    # Constexprs positionally, as in forward: HAS_MASK, HAS_BIAS, NEED_DS (dq only), LOW, BLOCK_M/N/D.
    launch_dq(
        q, k, v, m_arg, b_arg, o, do, lse, delta, dq, ds if ds is not None else delta, *strides, h, nq, nk, d,
        scale, inf, has_mask, has_bias, need_ds, low, bm, bn, bd)
    launch_dkdv(
        q, k, v, m_arg, b_arg, do, lse, delta, dk, dv, *strides, h, nq, nk, d, scale, inf, has_mask, has_bias, low,
        bm, bn, bd)
