"""Bias-activation fusions of Megatron-LM's MLP: bias + SwiGLU and bias + GELU (tanh approximation).

``bias_swiglu(input, bias)`` is ``silu(x₁ + b₁)·(x₂ + b₂)`` on the two halves of the last dim,
``swiglu(input)`` the same without a bias, ``bias_gelu(input, bias)`` Megatron's ``bias_gelu_impl``.
All differentiable in ``input`` and ``bias``; arithmetic in fp32, outputs in the input dtype.
"""

from __future__ import annotations

import torch

from apex.ops import bias_gelu as _gelu
from apex.ops import bias_swiglu as _swiglu

__all__ = ["bias_swiglu", "bias_gelu", "swiglu"]


def bias_swiglu(input: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x₁ + b₁)·(x₂ + b₂)``: ``input`` ``[..., 2n]``, ``bias`` ``[2n]`` → ``[..., n]``."""
    return _swiglu.bias_swiglu(input, bias)


def swiglu(input: torch.Tensor) -> torch.Tensor:
    """``silu(x₁)·x₂`` over the halves of ``input``'s last dim."""
    return _swiglu.swiglu(input)


def bias_gelu(input: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Tanh-approximate GELU of ``input + bias`` (``bias`` ``[input.shape[-1]]``)."""
    return _gelu.bias_gelu(input, bias)
