"""Compatibility module for code that does ``import fast_multihead_attn`` (Apex's compiled extension).

Only the fused masked-softmax-dropout entry points are provided; the whole-block entry points
(``self_attn_forward``, ...) took Apex's internal saved tensors and are not reproduced: use
``apex.contrib.multihead_attn``'s modules instead.
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.contrib.multihead_attn.mask_softmax_dropout_func"

# name -> module holding it
_OPS: dict[str, str] = {
    "mask_softmax_dropout_forward": _M,
    "mask_softmax_dropout_backward": _M,
    "additive_mask_softmax_dropout_forward": _M,
    "additive_mask_softmax_dropout_backward": _M,
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
