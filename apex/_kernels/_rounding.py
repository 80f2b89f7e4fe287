"""Rounding helpers shared by the optimizer kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast(x, DT: tl.constexpr):
    """fp32 ``x`` to ``DT`` rounding to nearest even.

    For bf16 the rounding is done on the bits (as PyTorch does), then the conversion is exact: the
    Triton interpreter truncates fp32 → bf16, which over many optimizer steps drifts the parameters.
    """
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (((bits >> 16) & 1) + 0x7FFF)
        bits = (bits >> 16) << 16  # shifts keep uint32 (a 0xFFFF0000 literal would widen to int64)
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(DT)
