"""Compatibility module for code that does ``import fast_multihead_attn`` (Apex's compiled extension).

The fused masked-softmax-dropout entry points come from ``mask_softmax_dropout_func``; the whole-block entry
points (``self_attn_forward``, ``encdec_multihead_attn_norm_add_backward``, ...) from ``_fast_blocks``, with
upstream's positional signatures and returned lists of saved tensors / gradients.
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.contrib.multihead_attn.mask_softmax_dropout_func"
_B = "apex.contrib.multihead_attn._fast_blocks"

# name -> module holding it
_OPS: dict[str, str] = {
    "mask_softmax_dropout_forward": _M,
    "mask_softmax_dropout_backward": _M,
    "additive_mask_softmax_dropout_forward": _M,
    "additive_mask_softmax_dropout_backward": _M,
    **{f"{block}_{direction}": _B
       for block in ("self_attn", "self_attn_bias", "self_attn_bias_additive_mask", "self_attn_norm_add",
                     "encdec_multihead_attn", "encdec_multihead_attn_norm_add")
       for direction in ("forward", "backward")},
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
