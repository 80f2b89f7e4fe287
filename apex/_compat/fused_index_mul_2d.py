"""Compatibility module for code that does ``import fused_index_mul_2d`` (Apex's compiled extension).

Names are resolved on first access from ``apex.ops.index_mul_2d``; as Apex's, they write into the tensors
passed first.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {name: "apex.ops.index_mul_2d" for name in (
    "float_forward", "float_backward", "float_backward_backward",
    "half_forward", "half_backward", "half_backward_backward")}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
