"""Fused rotary positional embedding (Megatron-LM's ``fused_apply_rotary_pos_emb*``).

Rotate-half RoPE on the first ``R`` columns of the head dimension (the rest pass through), forward and
backward (the transpose rotation) as one op each way; the tables (``freqs``, ``cos_``/``sin_``) get no
gradient. fp32 inputs compute in fp32 (fp64 in fp64); fp16/bf16 round as Apex's kernel does (cos/sin, each
product and the sum in the input dtype). See :mod:`apex.ops.fused_rope` for the semantics of each layout,
the dtypes and the errors.
"""

from __future__ import annotations

import torch

from apex.ops import fused_rope as _ops

__all__ = ["fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_cached", "fused_apply_rotary_pos_emb_thd",
           "fused_apply_rotary_pos_emb_2d"]


def fused_apply_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor,
                               transpose_output_memory: bool = False) -> torch.Tensor:
    """RoPE on ``t`` ``[s, b, h, d]`` with angles ``freqs`` ``[s, 1, 1, R]`` (``R ≤ d``, even).

    ``transpose_output_memory=True`` lays the output out as ``[b, s, h, d]`` in memory, so that
    ``output.transpose(0, 1)`` is contiguous.
    """
    return _ops.fused_rope(t, freqs, transpose_output_memory)


def fused_apply_rotary_pos_emb_cached(t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor,
                                      transpose_output_memory: bool = False) -> torch.Tensor:
    """RoPE on ``t`` ``[s, b, h, d]`` with cached ``cos_``/``sin_`` ``[s, 1, 1, R]`` (fp32 or ``t``'s dtype)."""
    return _ops.fused_rope_cached(t, cos_, sin_, transpose_output_memory)


def fused_apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE on packed sequences ``t`` ``[t, h, d]``: token ``i`` of sequence ``k`` (``cu_seqlens[k] ≤ i <
    cu_seqlens[k+1]``) is rotated by ``freqs[i − cu_seqlens[k]]``; ``freqs`` is ``[max_s, 1, 1, R]``."""
    return _ops.fused_rope_thd(t, cu_seqlens, freqs)


def fused_apply_rotary_pos_emb_2d(t: torch.Tensor, img_h: int, img_w: int, cos_h: torch.Tensor,
                                  sin_h: torch.Tensor, cos_w: torch.Tensor, sin_w: torch.Tensor) -> torch.Tensor:
    """2-D RoPE on ``t`` ``[b, img_h·img_w, h, d]``: the first ``d/2`` columns rotated by ``cos_h``/``sin_h``
    (``[1, ≥img_h, 1, d/2]``) at the row's height index, the rest by ``cos_w``/``sin_w`` at its width index."""
    return _ops.fused_rope_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
