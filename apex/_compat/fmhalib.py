"""Compatibility module for code that does ``import fmhalib`` (Apex's compiled FMHA extension).

Names are resolved on first access from ``apex.contrib.fmha``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {name: "apex.contrib.fmha.fmha" for name in ("fwd", "fwd_nl", "bwd", "bwd_nl")}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
