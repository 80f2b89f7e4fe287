"""Compatibility module for code that does ``import fused_layer_norm_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.ops``.
"""

from __future__ import annotations

from apex._compat import lazy_module

# name -> module holding it
_OPS: dict[str, str] = {
    "forward": "apex.ops.layer_norm",
    "forward_affine": "apex.ops.layer_norm",
    "forward_affine_mixed_dtypes": "apex.ops.layer_norm",
    "backward": "apex.ops.layer_norm",
    "backward_affine": "apex.ops.layer_norm",
    "rms_forward": "apex.ops.rms_norm",
    "rms_forward_affine": "apex.ops.rms_norm",
    "rms_forward_affine_mixed_dtypes": "apex.ops.rms_norm",
    "rms_backward": "apex.ops.rms_norm",
    "rms_backward_affine": "apex.ops.rms_norm",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
