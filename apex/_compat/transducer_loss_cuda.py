"""Compatibility module for code that does ``import transducer_loss_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.ops``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    "forward": "apex.ops.transducer_loss",
    "backward": "apex.ops.transducer_loss",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
