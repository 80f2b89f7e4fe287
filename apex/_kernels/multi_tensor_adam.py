"""Adam/AdamW over lists of tensors: one launch per (device, dtypes) group, one pass over memory.

Lists: grads, params, exp_avgs, exp_avg_sqs, masters (the masters list repeats the params when there are
none; it is then never touched). Each element is read once and written once: 28 bytes per fp32
parameter (g, p, m, v read; p, m, v written), plus the unscaled gradient write-back of the capturable
variants and the master's read/write with master weights.

Arithmetic is IEEE fp32 (``tl.div_rn``/``tl.sqrt_rn``; Triton's ``/`` and ``tl.sqrt`` are approximate on
NVIDIA GPUs), so results match PyTorch's fused Adam to about an ulp. ``1 - beta`` is computed on the host in
double: computed in the kernel from the fp32 ``beta2 = 0.999`` it would be 1.3e-5 off. The capturable
variants compute the bias corrections of the device-side ``step`` in fp64 from ``beta`` given as two fp32
parts, so they equal the host's ``1 - beta ** step`` rounded to fp32, as the non-capturable launch gets them.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt
from apex._kernels._rounding import cast
from apex._kernels.multi_tensor_lamb import _pow_int


@triton.jit
def _adam_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors,
                 noop_flag, lr_ptr, step_ptr, inv_scale_ptr,
                 lr_value, bc1_value, bc2_value, beta1, beta2, one_m_b1, one_m_b2, beta1_lo, beta2_lo,
                 eps, weight_decay,
                 G_DT: tl.constexpr, P_DT: tl.constexpr, M_DT: tl.constexpr, V_DT: tl.constexpr,
                 W_DT: tl.constexpr, MODE: tl.constexpr, CAPTURABLE: tl.constexpr,
                 BIAS_CORRECTION: tl.constexpr, HAS_MASTER: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 ALIGNED: tl.constexpr, PARTS: tl.constexpr = 1):
    # PARTS programs a chunk: each walks CHUNK // PARTS elements of it (mt.parts).
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    g_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED)
    p_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, P_DT, ALIGNED)
    m_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, M_DT, ALIGNED)
    v_ptr = mt.tensor_ptr(ptrs, 3, n_tensors, t, V_DT, ALIGNED)
    w_ptr = mt.tensor_ptr(ptrs, 4, n_tensors, t, W_DT, ALIGNED)
    if CAPTURABLE:
        # Device-side scalars: no host synchronisation, and a set noop flag masks every access.
        n = n * (tl.load(noop_flag) != 1).to(n.dtype)
        lr = tl.load(lr_ptr).to(tl.float32)
        inv_scale = tl.load(inv_scale_ptr).to(tl.float32)
        if BIAS_CORRECTION:
            step = tl.load(step_ptr).to(tl.int32)
            zero = tl.zeros([], tl.float64)
            bc1 = (1.0 - _pow_int((beta1 + zero) + beta1_lo, step)).to(tl.float32)
            bc2 = (1.0 - _pow_int((beta2 + zero) + beta2_lo, step)).to(tl.float32)
        else:
            bc1 = 1.0
            bc2 = 1.0
    else:
        lr = lr_value
        inv_scale = 1.0
        bc1 = bc1_value
        bc2 = bc2_value
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if HAS_MASTER:
            p = tl.load(w_ptr + idx, mask=mask, other=0.0)
        else:
            p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if CAPTURABLE:
            g = g * inv_scale
            tl.store(g_ptr + idx, cast(g, G_DT), mask=mask)
        if MODE == 0:
            g = g + weight_decay * p
        m = beta1 * m + one_m_b1 * g
        v = beta2 * v + one_m_b2 * g * g
        denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
        update = tl.div_rn(tl.div_rn(m, bc1), denom)
        if MODE == 1:
            update = update + weight_decay * p
        p = p - lr * update
        tl.store(p_ptr + idx, cast(p, P_DT), mask=mask)
        if HAS_MASTER:
            tl.store(w_ptr + idx, p, mask=mask)
        tl.store(m_ptr + idx, cast(m, M_DT), mask=mask)
        tl.store(v_ptr + idx, cast(v, V_DT), mask=mask)


def _f32(x: float) -> float:
    """``x`` rounded to fp32, as a launch passes it (the interpreter would pass it unrounded)."""
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def tables(lists) -> list:
    """The tables of Adam's launches over ``lists`` (``[g, p, m, v]`` or with masters), one per (device, dtypes)
    group: what :func:`run` launches over. An optimizer keeps them while its tensors' addresses repeat."""
    full = lists if len(lists) == 5 else lists + [lists[1]]
    return [mt.table(sub) for _, sub in mt.group(full)]


OP = "multi_tensor_adam"  # its name in apex._kernels._tuning (the sweep's, the measured table's)
_betas: dict = {}


def _beta_args(beta1: float, beta2: float) -> tuple:
    """(beta1, beta2 in fp32, 1 - each in double, the fp32 roundings' remainders): fixed while the betas are."""
    got = _betas.get((beta1, beta2))
    if got is None:
        if len(_betas) > 64:
            _betas.clear()
        b1_hi, b2_hi = _f32(beta1), _f32(beta2)
        got = _betas[(beta1, beta2)] = (b1_hi, b2_hi, 1.0 - beta1, 1.0 - beta2, beta1 - b1_hi, beta2 - b2_hi)
    return got


def run(tabs: list, has_master: bool, noop_flag, lr_t, step_t, inv_t, lr, bc1, bc2, beta1, beta2, eps,
        weight_decay, mode, bias_correction, *, capturable: bool) -> None:
    """One Adam launch per table of :func:`tables` (``has_master``: their lists had a master list)."""
    dummy = noop_flag
    args = (noop_flag, lr_t if capturable else dummy, step_t if capturable else dummy,
            inv_t if capturable else dummy, float(lr), float(bc1), float(bc2),
            *_beta_args(float(beta1), float(beta2)), float(eps), float(weight_decay))
    options = (int(mode), bool(capturable), bool(bias_correction), bool(has_master))
    for tab in tabs:  # (mt.launch's launch, inline; the grid and block as measured for it, see mt.parts)
        programs, parts, _, block, warps = mt.parts(OP, tab)
        _adam_kernel[(programs,)](tab.ptrs, tab.sizes, tab.chunk_tensor, tab.chunk_start, tab.n_tensors,
                                  *args, *tab.dtypes, *options, tab.chunk, block, tab.aligned, parts,
                                  num_warps=warps)


def adam(noop_flag, lists, lr_t, step_t, inv_t, lr, bc1, bc2, beta1, beta2, eps, weight_decay, mode,
         bias_correction, *, capturable: bool) -> None:
    run(tables(lists), len(lists) == 5, noop_flag, lr_t, step_t, inv_t, lr, bc1, bc2, beta1, beta2, eps,
        weight_decay, mode, bias_correction, capturable=capturable)
