"""``out = a * x + b * y`` over lists of tensors, flagging non-finite inputs. One launch per dtype group."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt


@triton.jit
def _axpby_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, noop_flag, a, b,
                  X_DT: tl.constexpr, Y_DT: tl.constexpr, OUT_DT: tl.constexpr,
                  CHECK_X: tl.constexpr, CHECK_Y: tl.constexpr, ALIGNED: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr = 1):
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    x_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, X_DT, ALIGNED)
    y_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, Y_DT, ALIGNED)
    o_ptr = mt.tensor_ptr(ptrs, 2, n_tensors, t, OUT_DT, ALIGNED)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        if CHECK_X:
            mt.flag_nonfinite(noop_flag, x, mask)
        if CHECK_Y:
            mt.flag_nonfinite(noop_flag, y, mask)
        tl.store(o_ptr + idx, (a * x + b * y).to(OUT_DT), mask=mask)


OP = "multi_tensor_axpby"  # its name in apex._kernels._tuning (mt.parts' grid: element-wise)


def axpby(noop_flag: torch.Tensor, xs: list, ys: list, outs: list, a: float, b: float, arg_to_check: int) -> None:
    for _, sub in mt.group([xs, ys, outs]):
        tab = mt.table(sub)
        mt.launch(_axpby_kernel, tab, noop_flag, float(a), float(b),
                  options=(arg_to_check in (-1, 0), arg_to_check in (-1, 1), tab.aligned), op=OP)
