"""Compatibility module for code that does ``import fused_bias_swiglu`` (ROCm Apex's compiled extension):
``forward(input, bias)`` and ``backward(grad_output, input, bias)`` (the gradient of ``input``).

Names are resolved on first access from ``apex.ops.bias_swiglu``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    "forward": "apex.ops.bias_swiglu:bias_swiglu_forward",
    "backward": "apex.ops.bias_swiglu:bias_swiglu_backward",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
