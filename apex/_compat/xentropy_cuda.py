"""Compatibility module for code that does ``import xentropy_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.ops.xentropy``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "forward": "apex.ops.xentropy",
    "backward": "apex.ops.xentropy",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
