"""``SelfMultiheadAttn``: Apex's self-attention block (optionally with the pre-LayerNorm and residual add)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import Parameter

from apex.contrib.multihead_attn._functional import attention, check_inputs, merge_heads, split_heads
from apex.contrib.multihead_attn._norm_add import NormAdd


class SelfMultiheadAttn(NormAdd, nn.Module):
    """Multi-headed self-attention on ``[seq, batch, embed]`` inputs ("Attention Is All You Need").

    ``include_norm_add=True`` computes ``query + dropout(attn(layer_norm(query)))``. ``impl="fast"`` runs
    ``F.scaled_dot_product_attention``; ``impl="default"`` the explicit composition. Parameter names match
    Apex's (``in_proj_weight`` or ``q/k/v_weight``, ``out_proj_weight``, ``lyr_nrm_*``), so state_dicts load.
    ``forward`` returns ``(output, None)``; dropout is applied when ``is_training`` is true.
    """

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=False, include_norm_add=False, impl="fast",
                 separate_qkv_params=False, mask_additive=False):
        super().__init__()
        if impl not in ("fast", "default"):
            raise ValueError(f"impl must be 'fast' or 'default', got {impl!r}")
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if mask_additive and include_norm_add:
            raise ValueError("mask_additive is not supported with include_norm_add")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.bias = bias
        self.include_norm_add = include_norm_add
        self.impl = impl
        self.scaling = self.head_dim ** -0.5
        self.separate_qkv_params = separate_qkv_params
        self.mask_additive = mask_additive
        if separate_qkv_params:
            self.q_weight = Parameter(torch.empty(embed_dim, embed_dim))
            self.k_weight = Parameter(torch.empty(embed_dim, embed_dim))
            self.v_weight = Parameter(torch.empty(embed_dim, embed_dim))
        else:
            self.in_proj_weight = Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.out_proj_weight = Parameter(torch.empty(embed_dim, embed_dim))
        names = ("q_bias", "k_bias", "v_bias") if separate_qkv_params else ("in_proj_bias",)
        for name in names:
            size = embed_dim if separate_qkv_params else 3 * embed_dim
            self.register_parameter(name, Parameter(torch.empty(size)) if bias else None)
        self.register_parameter("out_proj_bias", Parameter(torch.empty(embed_dim)) if bias else None)
        self._init_norm_add(embed_dim, include_norm_add, impl)
        self.reset_parameters()

    def reset_parameters(self):
        if self.separate_qkv_params:
            for w in (self.q_weight, self.k_weight, self.v_weight):
                nn.init.xavier_uniform_(w)
        else:
            # (3E, E) initialised like an (E, E) matrix: gain sqrt(2) compensates Xavier's fan sum.
            nn.init.xavier_uniform_(self.in_proj_weight, gain=math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj_weight)
        if self.bias:
            for b in self._input_biases():
                nn.init.zeros_(b)
            nn.init.zeros_(self.out_proj_bias)
        self._reset_norm_add()

    def _input_biases(self):
        return (self.q_bias, self.k_bias, self.v_bias) if self.separate_qkv_params else (self.in_proj_bias,)

    def _input_projection(self):
        """The packed (3E, E) weight and (3E,) bias in Apex's per-head [q, k, v] row order."""
        H, d, E = self.num_heads, self.head_dim, self.embed_dim
        if self.separate_qkv_params:
            w = torch.stack([p.view(H, d, E) for p in (self.q_weight, self.k_weight, self.v_weight)], 1)
            w = w.reshape(3 * E, E)
            b = (torch.stack([p.view(H, d) for p in self._input_biases()], 1).reshape(3 * E) if self.bias
                 else None)
            return w, b
        return self.in_proj_weight, self.in_proj_bias

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
                is_training=True):
        """Inputs ``[seq, batch, embed]`` (``key`` and ``value`` are ignored: this is self-attention)."""
        check_inputs(query, self.embed_dim)
        if key_padding_mask is not None and attn_mask is not None:
            raise ValueError("attn_mask and key_padding_mask cannot both be given")
        if attn_mask is not None and self.mask_additive:
            raise ValueError("an additive mask is supported for key_padding_mask only, not attn_mask")
        mask = key_padding_mask if key_padding_mask is not None else attn_mask
        x = self._pre_norm(query)
        w, b = self._input_projection()
        q, k, v = split_heads(F.linear(x, w, b), self.num_heads, 3)
        ctx = attention(q, k, v, mask, attn_mask is not None, self.mask_additive, self.scaling, self.dropout,
                        is_training, self.impl)
        out = F.linear(merge_heads(ctx), self.out_proj_weight, self.out_proj_bias)
        if self.include_norm_add:
            out = F.dropout(out, p=self.dropout, training=bool(is_training)) + query
        return out, None
