"""Compatibility module for ``import cudnn_gbn_lib`` (Apex's cuDNN group batch norm kernels).

``forward``/``backward`` keep Apex's positional signatures (``apex.contrib.cudnn_gbn._compat``); only
``bn_group == 1`` is served, groups of ranks go through ``apex.contrib.cudnn_gbn.GroupBatchNorm2d``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "forward": "apex.contrib.cudnn_gbn._compat",
    "backward": "apex.contrib.cudnn_gbn._compat",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
