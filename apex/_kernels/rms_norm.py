"""RMSNorm forward and backward launchers (kernels in ``_kernels/_norm.py``) on 2-D row views."""

from __future__ import annotations

import torch

from apex._kernels import _norm


def forward(x: torch.Tensor, weight, eps: float, out_dtype: torch.dtype,
            residual: torch.Tensor | None = None, residual_dtype: torch.dtype | None = None,
            out_like: torch.Tensor | None = None):
    """Returns ``(y, rstd, h)``; ``h = x + residual`` when a residual is given, else None; ``y`` and ``h``
    shaped as ``out_like`` when given (see ``_norm.forward``)."""
    y, _, rstd, h = _norm.forward(x, weight, None, eps, out_dtype, True, residual, residual_dtype, out_like)
    return y, rstd, h


def backward(dy: torch.Tensor, v: torch.Tensor, weight, rstd, memory_efficient: bool,
             dx_dtype: torch.dtype, dresidual: torch.Tensor | None = None, eps: float | None = None,
             out_like: torch.Tensor | None = None):
    """Returns ``(dx, dweight)``; ``dresidual`` is added to ``dx``; ``eps``: the forward's, ``out_like``:
    ``dx``'s shape (see ``_norm``)."""
    dx, dw, _ = _norm.backward(dy, v, weight, None, None, rstd, memory_efficient, True, dx_dtype, dresidual,
                               eps, out_like)
    return dx, dw
