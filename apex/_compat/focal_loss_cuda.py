"""Compatibility module for code that does ``import focal_loss_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.ops.focal_loss``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "forward": "apex.ops.focal_loss",
    "backward": "apex.ops.focal_loss",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
