"""Compatibility module for code that does ``import fused_dense_cuda`` (Apex's cuBLASLt dense extension).

Names are resolved on first access from ``apex.ops.fused_dense``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    "linear_bias_forward": "apex.ops.fused_dense",
    "linear_bias_backward": "apex.ops.fused_dense",
    "linear_gelu_linear_forward": "apex.ops.fused_dense",
    "linear_gelu_linear_backward": "apex.ops.fused_dense",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
