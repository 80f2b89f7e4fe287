"""Compatibility module for code that does ``import group_norm_cuda`` (Apex's compiled NHWC GroupNorm).

Names are resolved on first access from ``apex.ops.group_norm``. ``sums`` passed between ``forward`` and
``backward`` holds (mean, rstd) pairs, our own layout: use them only with each other.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "forward": "apex.ops.group_norm",
    "backward": "apex.ops.group_norm",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
