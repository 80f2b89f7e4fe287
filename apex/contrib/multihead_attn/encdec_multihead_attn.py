"""``EncdecMultiheadAttn``: Apex's encoder-decoder attention block (optionally with pre-LayerNorm and add)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from apex.contrib.multihead_attn._functional import attention, check_inputs, merge_heads, split_heads
from apex.contrib.multihead_attn._norm_add import NormAdd


class EncdecMultiheadAttn(NormAdd, nn.Module):
    """Multi-headed attention of decoder states ``query`` over encoder states ``key`` (``[seq, batch, embed]``).

    Parameter names match Apex's (``in_proj_weight_q``, ``in_proj_weight_kv`` with per-head [k, v] rows,
    ``out_proj_weight``, ``lyr_nrm_*``). ``forward`` returns ``(output, None)``.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=False, include_norm_add=False, impl="fast"):
        super().__init__()
        if impl not in ("fast", "default"):
            raise ValueError(f"impl must be 'fast' or 'default', got {impl!r}")
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.bias = bias
        self.include_norm_add = include_norm_add
        self.impl = impl
        self.scaling = self.head_dim ** -0.5
        self.in_proj_weight_q = Parameter(torch.empty(embed_dim, embed_dim))
        self.in_proj_weight_kv = Parameter(torch.empty(2 * embed_dim, embed_dim))
        self.out_proj_weight = Parameter(torch.empty(embed_dim, embed_dim))
        # Apex's fast kernels had no biases; here both implementations accept them.
        for name, size in (("in_proj_bias_q", embed_dim), ("in_proj_bias_kv", 2 * embed_dim),
                           ("out_proj_bias", embed_dim)):
            self.register_parameter(name, Parameter(torch.empty(size)) if bias else None)
        self._init_norm_add(embed_dim, include_norm_add, impl)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.in_proj_weight_q)
        nn.init.xavier_uniform_(self.in_proj_weight_kv, gain=math.sqrt(1.5))
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for b in (self.in_proj_bias_q, self.in_proj_bias_kv, self.out_proj_bias):
                nn.init.zeros_(b)
        self._reset_norm_add()

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
                is_training=True):
        """``query`` [tgt, batch, embed], ``key`` [src, batch, embed] (``value`` is ignored: kv come from key)."""
        check_inputs(query, self.embed_dim)
        check_inputs(key, self.embed_dim, "key")
        if key.shape[1] != query.shape[1]:
            raise ValueError(f"key has batch size {key.shape[1]} but query has {query.shape[1]}")
        if key_padding_mask is not None and attn_mask is not None:
            raise ValueError("attn_mask and key_padding_mask cannot both be given")
        mask = key_padding_mask if key_padding_mask is not None else attn_mask
        x = self._pre_norm(query)
        (q,) = split_heads(F.linear(x, self.in_proj_weight_q, self.in_proj_bias_q), self.num_heads, 1)
        k, v = split_heads(F.linear(key, self.in_proj_weight_kv, self.in_proj_bias_kv), self.num_heads, 2)
        ctx = attention(q, k, v, mask, attn_mask is not None, False, self.scaling, self.dropout, is_training,
                        self.impl)
        out = F.linear(merge_heads(ctx), self.out_proj_weight, self.out_proj_bias)
        if self.include_norm_add:
            out = F.dropout(out, p=self.dropout, training=bool(is_training)) + query
        return out, None
