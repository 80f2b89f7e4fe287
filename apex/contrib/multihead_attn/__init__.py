"""Apex's ``apex.contrib.multihead_attn``: self and encoder-decoder multi-head attention blocks on
``F.scaled_dot_product_attention`` (``impl="fast"``) or the plain composition (``impl="default"``)."""

from apex.contrib.multihead_attn.encdec_multihead_attn import EncdecMultiheadAttn
from apex.contrib.multihead_attn.mask_softmax_dropout_func import fast_mask_softmax_dropout_func
from apex.contrib.multihead_attn.self_multihead_attn import SelfMultiheadAttn

__all__ = ["EncdecMultiheadAttn", "SelfMultiheadAttn", "fast_mask_softmax_dropout_func"]
