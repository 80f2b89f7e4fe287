"""Compatibility module for code that does ``import fused_layer_norm_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.ops``.
"""

from __future__ import annotations

import importlib

# name -> module holding it
_OPS: dict[str, str] = {}

__all__ = sorted(_OPS)


def __getattr__(name: str):
    module = _OPS.get(name)
    if module is None:
        raise AttributeError(f"module 'fused_layer_norm_cuda' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
