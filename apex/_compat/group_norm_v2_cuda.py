"""Compatibility module for ``import group_norm_v2_cuda`` (Apex's second NHWC GroupNorm kernels).

``gn``/``gn_bwd`` keep Apex's signatures and its ``mean_var`` layout; see ``apex.ops._group_norm_v2_compat``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "gn": "apex.ops._group_norm_v2_compat",
    "gn_bwd": "apex.ops._group_norm_v2_compat",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
