"""Compatibility module for code that does ``import fused_weight_gradient_mlp_cuda`` (Apex's compiled
weight-gradient accumulation, used by Megatron-LM's ``gradient_accumulation_fusion``).

Names are resolved on first access from ``apex.ops.wgrad_accum``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    "wgrad_gemm_accum_fp32": "apex.ops.wgrad_accum",
    "wgrad_gemm_accum_fp16": "apex.ops.wgrad_accum",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
