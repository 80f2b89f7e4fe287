"""The attention computation shared by ``SelfMultiheadAttn`` and ``EncdecMultiheadAttn``.

Layout (Apex's, so that its state_dicts load): inputs are ``[seq, batch, embed]``; the packed input
projection's rows are grouped per head, ``[head0 q, head0 k, head0 v, head1 q, ...]`` (each ``head_dim``
rows), and the encoder-decoder ``kv`` projection likewise ``[head0 k, head0 v, head1 k, ...]``.

Masks: ``key_padding_mask`` (batch, src_len), nonzero = padding, excluded from the softmax (or, with
``mask_additive``, a float mask added to the scores); ``attn_mask`` (tgt_len, src_len), nonzero = masked.

``impl="fast"`` runs ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where PyTorch has
them, no materialised probabilities); ``impl="default"`` the plain composition (scores, softmax, dropout,
matmul). Dtype policy: PyTorch's, in the input dtype (matmuls accumulate in fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def split_heads(lin: Tensor, heads: int, parts: int) -> list[Tensor]:
    """(S, B, parts·E) projections grouped per head → ``parts`` tensors of (B, heads, S, head_dim)."""
    S, B, width = lin.shape
    d = width // (parts * heads)
    lin = lin.view(S, B, heads, parts, d).permute(3, 1, 2, 0, 4)
    return list(lin.unbind(0))


def _check_mask(mask: Tensor, name: str, shape: tuple[int, int]) -> None:
    if not isinstance(mask, Tensor) or tuple(mask.shape) != shape:
        got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"{name} must have shape {shape}, got {got}")


def sdpa_mask(mask: Tensor | None, use_time_mask: bool, additive: bool, B: int, Sq: int, Sk: int,
              dtype: torch.dtype) -> Tensor | None:
    """Apex's mask conventions → an SDPA ``attn_mask`` (bool: True = attend; float: added to the scores)."""
    if mask is None:
        return None
    if use_time_mask:
        _check_mask(mask, "attn_mask", (Sq, Sk))
        return ~mask.to(torch.bool)
    _check_mask(mask, "key_padding_mask", (B, Sk))
    if additive:
        return mask.to(dtype).view(B, 1, 1, Sk)
    return ~mask.to(torch.bool).view(B, 1, 1, Sk)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, use_time_mask: bool, additive: bool,
              scale: float, dropout_prob: float, is_training: bool, impl: str) -> Tensor:
    """``softmax(q kᵀ·scale + mask) v`` with dropout on the probabilities; q, k, v are (B, H, S, D)."""
    B, _, Sq, _ = q.shape
    Sk = k.shape[2]
    m = sdpa_mask(mask, use_time_mask, additive, B, Sq, Sk, q.dtype)
    p = dropout_prob if is_training else 0.0
    if impl == "fast":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=p, scale=scale)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if m is not None:
        scores = scores + m if m.dtype != torch.bool else scores.masked_fill(~m, float("-inf"))
    probs = F.dropout(torch.softmax(scores, dim=-1), p=p, training=p > 0)
    return torch.matmul(probs, v)


def merge_heads(ctx: Tensor) -> Tensor:
    """(B, H, S, D) → (S, B, H·D)."""
    B, H, S, D = ctx.shape
    return ctx.permute(2, 0, 1, 3).reshape(S, B, H * D)


def check_inputs(query: Tensor, embed_dim: int, name: str = "query") -> None:
    if not isinstance(query, Tensor) or query.dim() != 3 or query.shape[-1] != embed_dim:
        got = tuple(query.shape) if isinstance(query, Tensor) else type(query).__name__
        raise ValueError(f"{name} must be [seq, batch, {embed_dim}], got {got}")
