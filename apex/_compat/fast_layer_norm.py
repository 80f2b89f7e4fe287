"""Compatibility module for code that does ``import fast_layer_norm`` (Apex's contrib LayerNorm extension).

Names are resolved on first access from ``apex.contrib.layer_norm.layer_norm``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "ln_fwd": "apex.contrib.layer_norm.layer_norm",
    "ln_bwd": "apex.contrib.layer_norm.layer_norm",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
