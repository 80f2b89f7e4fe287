"""Compatibility module for code that does ``import mlp_cuda`` (Apex's compiled MLP extension).

Names are resolved on first access from ``apex.ops.mlp``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    "forward": "apex.ops.mlp",
    "backward": "apex.ops.mlp",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
