"""Adagrad over lists of tensors: one launch per (device, dtypes) group, one pass.

Lists: grads, params, sums. 20 bytes per fp32 parameter (g, p, h read; p, h written). IEEE fp32 division
and square root (``tl.div_rn``/``tl.sqrt_rn``; ``/`` and ``tl.sqrt`` are approximate on NVIDIA GPUs).
"""

from __future__ import annotations

import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt
from apex._kernels._rounding import cast


@triton.jit
def _adagrad_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, lr, eps, weight_decay,
                    G_DT: tl.constexpr, P_DT: tl.constexpr, H_DT: tl.constexpr,
                    MODE: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                    PARTS: tl.constexpr = 1):
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    g_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, G_DT, ALIGNED)
    p_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, P_DT, ALIGNED)
    h_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, H_DT, ALIGNED)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        g = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if MODE == 0:
            g = g + weight_decay * p
            h = h + g * g
            p = p - lr * tl.div_rn(g, tl.sqrt_rn(h) + eps)
        else:
            h = h + g * g
            p = p - lr * (tl.div_rn(g, tl.sqrt_rn(h) + eps) + weight_decay * p)
        tl.store(p_ptr + idx, cast(p, P_DT), mask=mask)
        tl.store(h_ptr + idx, cast(h, H_DT), mask=mask)


OP = "multi_tensor_adagrad"  # its name in apex._kernels._tuning (mt.parts' grid: element-wise)


def adagrad(lists, lr: float, eps: float, mode: int, weight_decay: float) -> None:
    for _, sub in mt.group(lists):
        tab = mt.table(sub)
        mt.launch(_adagrad_kernel, tab, float(lr), float(eps), float(weight_decay), options=(int(mode), tab.aligned),
                  op=OP)
