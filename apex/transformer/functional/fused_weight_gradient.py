"""Weight-gradient accumulation into ``main_grad`` (Megatron-LM's gradient-accumulation fusion).

``wgrad_gemm_accum_fp32(input, grad_output, main_grad)``: ``main_grad += grad_outputᵀ @ input`` over all
leading dims, in place, for an fp32 ``main_grad``; ``wgrad_gemm_accum_fp16`` for an fp16/bf16 one. Products
are accumulated in fp32; see :mod:`apex.ops.wgrad_accum`.
"""

from __future__ import annotations

from apex.ops.wgrad_accum import wgrad_gemm_accum_fp16, wgrad_gemm_accum_fp32

__all__ = ["wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"]
