"""Compatibility module for code that does ``import fused_conv_bias_relu`` (Apex's compiled extension).

Names are resolved on first access from ``apex.contrib.conv_bias_relu``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.contrib.conv_bias_relu.conv_bias_relu"

# name -> module holding it
_OPS: dict[str, str] = {name: _M for name in (
    "forward", "backward", "forward_no_relu", "backward_no_relu", "forward_mask", "forward_cscale_cbias_relu",
    "backward_cscale_cbias_relu")}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
