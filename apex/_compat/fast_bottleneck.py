"""Compatibility module for code that does ``import fast_bottleneck`` (Apex's compiled extension).

Names are resolved on first access from ``apex.contrib.bottleneck._fast_bottleneck``: the whole-block
``forward`` and ``backward``. The staged entry points Apex's SpatialBottleneck used (``forward_out1``,
``forward_out2_halo``, ``backward_grad_out1_halo``, ...) are not provided: apex's SpatialBottleneck runs on
autograd with a differentiable halo exchange instead.
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.contrib.bottleneck._fast_bottleneck"

# name -> module holding it
_OPS: dict[str, str] = {"forward": _M, "backward": _M}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
