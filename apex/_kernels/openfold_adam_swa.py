"""Adam step + copy to the compute (bf16) parameters + SWA average in one pass, over lists of tensors.

Lists, in order: grads (on the compute parameters), state parameters, compute parameters, SWA parameters,
``exp_avg``, ``exp_avg_sq``. Arithmetic is fp64 for fp64 state parameters and fp32 otherwise; the
hyperparameters come from a small fp64 tensor (so fp64 state is updated with fp64 ``lr``/``betas``, not
their fp32 roundings). Per element: read g, p, m, v, s; write p, c, m, v, s (the SWA read is skipped on
the first average, which is a copy). ``1 - beta`` and ``1 - decay`` are taken in fp64 before the rounding to
fp32 (from an fp32 ``beta2 = 0.999`` it would be 1.3e-5 off), and fp32 division and square root are the IEEE
ones (``tl.div_rn``/``tl.sqrt_rn``; ``/`` and ``tl.sqrt`` are approximate on NVIDIA GPUs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt

# Positions in the hyperparameter tensor.
LR, BETA1, BETA2, EPS, WD, BC1, BC2, DECAY = range(8)


@triton.jit
def _to(x, DT: tl.constexpr):
    # fp64 → 16-bit through fp32, as PyTorch rounds (and the interpreter cannot cast fp64 to bf16).
    if DT == tl.float64:
        return x.to(DT)
    return x.to(tl.float32).to(DT)


@triton.jit
def _div(x, y, CT: tl.constexpr):
    if CT == tl.float64:
        r = x / y  # fp64 division is IEEE (div.rn.f64)
    else:
        r = tl.div_rn(x, y)
    return r


@triton.jit
def _sqrt(x, CT: tl.constexpr):
    if CT == tl.float64:
        r = tl.sqrt(x)  # fp64 square root is IEEE (sqrt.rn.f64)
    else:
        r = tl.sqrt_rn(x)
    return r


@triton.jit
def _ptr(ptrs, list_index, n_tensors, t, DT: tl.constexpr, ALIGNED: tl.constexpr, WIDE: tl.constexpr):
    """:func:`mt.tensor_ptr`; with ``WIDE`` (a list of fp64) known aligned to 2 elements, not 4: a 16-byte
    vector holds 2 fp64, and 4-element vectors of the 16-bit lists beside them cost a shared-memory layout
    conversion (bf16 beside fp64 on sm_90: 16 barriers a pass and 144 registers; 2 elements a vector in every
    list: none, and 128)."""
    if WIDE:
        p = mt.tensor_ptr(ptrs, list_index, n_tensors, t, DT)
        if ALIGNED:
            p = tl.multiple_of(p, DT.primitive_bitwidth // 4)
    else:
        p = mt.tensor_ptr(ptrs, list_index, n_tensors, t, DT, ALIGNED)
    return p


@triton.jit
def _adam_swa_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, hyper, clip_ptr,
                     G_DT: tl.constexpr, P_DT: tl.constexpr, C_DT: tl.constexpr, S_DT: tl.constexpr,
                     M_DT: tl.constexpr, V_DT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                     MODE: tl.constexpr, FIRST_AVERAGE: tl.constexpr, CT: tl.constexpr, ALIGNED: tl.constexpr,
                     PARTS: tl.constexpr = 1):
    # (ALIGNED: the table's ``aligned``: vector accesses, see _ptr)
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    wide = (G_DT == tl.float64) | (P_DT == tl.float64) | (C_DT == tl.float64) | (S_DT == tl.float64) | \
        (M_DT == tl.float64) | (V_DT == tl.float64)
    g_ptr = _ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED, wide)
    p_ptr = _ptr(ptrs, 1, n_tensors, t, P_DT, ALIGNED, wide)
    c_ptr = _ptr(ptrs, 2, n_tensors, t, C_DT, ALIGNED, wide)
    s_ptr = _ptr(ptrs, 3, n_tensors, t, S_DT, ALIGNED, wide)
    m_ptr = _ptr(ptrs, 4, n_tensors, t, M_DT, ALIGNED, wide)
    v_ptr = _ptr(ptrs, 5, n_tensors, t, V_DT, ALIGNED, wide)
    lr = tl.load(hyper + 0).to(CT)
    beta1 = tl.load(hyper + 1).to(CT)
    beta2 = tl.load(hyper + 2).to(CT)
    eps = tl.load(hyper + 3).to(CT)
    wd = tl.load(hyper + 4).to(CT)
    bc1 = tl.load(hyper + 5).to(CT)
    bc2 = tl.load(hyper + 6).to(CT)
    one_m_b1 = (1.0 - tl.load(hyper + 1)).to(CT)
    one_m_b2 = (1.0 - tl.load(hyper + 2)).to(CT)
    one_m_decay = (1.0 - tl.load(hyper + 7)).to(CT)
    clip = tl.load(clip_ptr).to(CT)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(CT) * clip
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(CT)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(CT)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(CT)
        if MODE != 1:  # L2 penalty folded into the gradient (Apex Adam, PyTorch Adam)
            g = g + wd * p
        m = beta1 * m + one_m_b1 * g
        v = beta2 * v + one_m_b2 * g * g
        if MODE == 2:  # PyTorch's order: step size lr/bc1, denominator sqrt(v)/sqrt(bc2) + eps
            p = p - _div(lr, bc1, CT) * _div(m, _div(_sqrt(v, CT), _sqrt(bc2, CT), CT) + eps, CT)
        else:
            update = _div(_div(m, bc1, CT), _sqrt(_div(v, bc2, CT), CT) + eps, CT)
            if MODE == 1:  # decoupled weight decay (Apex AdamW)
                update = update + wd * p
            p = p - lr * update
        if FIRST_AVERAGE:
            s = p
        else:
            s = tl.load(s_ptr + idx, mask=mask, other=0.0).to(CT)
            s = s + one_m_decay * (p - s)
        tl.store(p_ptr + idx, _to(p, P_DT), mask=mask)
        tl.store(c_ptr + idx, _to(p, C_DT), mask=mask)
        tl.store(s_ptr + idx, _to(s, S_DT), mask=mask)
        tl.store(m_ptr + idx, _to(m, M_DT), mask=mask)
        tl.store(v_ptr + idx, _to(v, V_DT), mask=mask)


OP = "openfold_adam_swa"  # its name in apex._kernels._tuning (mt.parts' grid: element-wise)


def adam_swa(lists, hyper: torch.Tensor, clip: torch.Tensor, mode: int, first_average: bool) -> None:
    """One launch per group of tensors sharing (device, dtype of each list). ``hyper``: fp64 tensor indexed
    by ``LR … DECAY`` on the parameters' device; ``clip``: one-element tensor scaling the gradients."""
    for _, sub in mt.group(lists):
        ct = tl.float64 if sub[1][0].dtype == torch.float64 else tl.float32
        tab = mt.table(sub)
        mt.launch(_adam_swa_kernel, tab, hyper, clip, MODE=int(mode), FIRST_AVERAGE=bool(first_average), CT=ct,
                  ALIGNED=tab.aligned, op=OP)
