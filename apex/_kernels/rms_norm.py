"""RMSNorm forward and backward launchers (kernels in ``_kernels/_norm.py``) on 2-D row views."""

from __future__ import annotations

import torch

from apex._kernels import _norm


def forward(x: torch.Tensor, weight, eps: float, out_dtype: torch.dtype,
            residual: torch.Tensor | None = None, residual_dtype: torch.dtype | None = None):
    """Returns ``(y, rstd, h)``; ``h = x + residual`` when a residual is given, else None."""
    y, _, rstd, h = _norm.forward(x, weight, None, eps, out_dtype, True, residual, residual_dtype)
    return y, rstd, h


def backward(dy: torch.Tensor, v: torch.Tensor, weight, rstd, memory_efficient: bool,
             dx_dtype: torch.dtype, dresidual: torch.Tensor | None = None, eps: float | None = None):
    """Returns ``(dx, dweight)``; ``dresidual`` is added to ``dx``; ``eps``: the forward's (see ``_norm``)."""
    dx, dw, _ = _norm.backward(dy, v, weight, None, None, rstd, memory_efficient, True, dx_dtype, dresidual,
                               eps)
    return dx, dw
