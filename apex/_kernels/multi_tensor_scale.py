"""``out = in * scale`` over lists of tensors, flagging non-finite inputs. One launch per dtype group."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import multi_tensor as mt


@triton.jit
def _scale_kernel(ptrs, sizes, chunk_tensor, chunk_start, n_tensors, noop_flag, scale,
                  IN_DT: tl.constexpr, OUT_DT: tl.constexpr, SCALE_IS_PTR: tl.constexpr, ALIGNED: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr = 1):
    # PARTS programs a chunk, each walking CHUNK // PARTS elements of it (mt.parts)
    t, start, n = mt.chunk_coords(sizes, chunk_tensor, chunk_start, ALIGNED, PARTS, CHUNK // PARTS)
    if SCALE_IS_PTR:
        # A device-side scale (e.g. a clipping coefficient) is read here, so the host never waits for it.
        scale = tl.load(scale).to(tl.float32)
    x_ptr = mt.tensor_ptr(ptrs, 0, n_tensors, t, IN_DT, ALIGNED)
    o_ptr = mt.tensor_ptr(ptrs, 1, n_tensors, t, OUT_DT, ALIGNED)
    for off in range(0, CHUNK // PARTS, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        mask = idx < n
        x = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        mt.flag_nonfinite(noop_flag, x, mask)
        tl.store(o_ptr + idx, (x * scale).to(OUT_DT), mask=mask)


OP = "multi_tensor_scale"  # its name in apex._kernels._tuning (mt.parts' grid: element-wise)


def scale(noop_flag: torch.Tensor, inputs: list, outputs: list, scale: float | torch.Tensor) -> None:
    """``scale`` is a Python number or a one-element tensor on the inputs' device."""
    is_ptr = isinstance(scale, torch.Tensor)
    for _, (ins, outs) in mt.group([inputs, outputs]):
        tab = mt.table([ins, outs])
        mt.launch(_scale_kernel, tab, noop_flag, scale if is_ptr else float(scale), options=(is_ptr, tab.aligned),
                  op=OP, default_parts=1)
