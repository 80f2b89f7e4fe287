"""Compatibility module for code that does ``import fused_rotary_positional_embedding`` (Apex's compiled
RoPE extension). Upstream's positional signatures; no autograd (the callers wrap them in a Function).

Names are resolved on first access from ``apex.ops.fused_rope``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    name: "apex.ops.fused_rope"
    for name in ("forward", "backward", "forward_cached", "backward_cached", "forward_thd", "backward_thd",
                 "forward_2d", "backward_2d")
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
