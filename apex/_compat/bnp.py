"""Compatibility module for code that does ``import bnp`` (Apex's compiled group-batch-norm extension).

Only the occupancy queries are provided; the kernels and IPC buffer functions have no equivalent: use
``apex.contrib.groupbn.BatchNorm2d_NHWC``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.contrib.groupbn.batch_norm"

# name -> module holding it
_OPS: dict[str, str] = {name: _M for name in (
    "bn_fwd_nhwc_occupancy", "bn_bwd_nhwc_occupancy", "bn_addrelu_fwd_nhwc_occupancy",
    "bn_addrelu_bwd_nhwc_occupancy")}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
