"""LayerNorm forward and backward launchers (kernels in ``_kernels/_norm.py``) on 2-D row views."""

from __future__ import annotations

import torch

from apex._kernels import _norm


def forward(x: torch.Tensor, weight, bias, eps: float, out_dtype: torch.dtype,
            residual: torch.Tensor | None = None, residual_dtype: torch.dtype | None = None,
            out_like: torch.Tensor | None = None):
    """Returns ``(y, mean, rstd, h)``; ``h = x + residual`` when a residual is given, else None; ``y`` and
    ``h`` shaped as ``out_like`` when given (see ``_norm.forward``)."""
    return _norm.forward(x, weight, bias, eps, out_dtype, False, residual, residual_dtype, out_like)


def backward(dy: torch.Tensor, v: torch.Tensor, weight, bias, mean, rstd, memory_efficient: bool,
             dx_dtype: torch.dtype, dresidual: torch.Tensor | None = None, eps: float | None = None,
             out_like: torch.Tensor | None = None):
    """Returns ``(dx, dweight, dbias)``; ``dresidual`` is added to ``dx``; ``eps``: the forward's, ``out_like``:
    ``dx``'s shape (see ``_norm``)."""
    return _norm.backward(dy, v, weight, bias, mean, rstd, memory_efficient, False, dx_dtype, dresidual, eps,
                          out_like)
