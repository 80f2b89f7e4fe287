"""Apex's "fast" LayerNorm over the last dimension: ``FastLayerNorm``, ``FastLayerNormFN``, ``_fast_layer_norm``.

Same math as ``apex.normalization.FusedLayerNorm`` and the same kernels (``apex.ops.layer_norm``: one-pass
Triton kernels on GPUs, PyTorch's fused LayerNorm on CPUs); Apex's dtype rules for this variant: the output
has the dtype of ``gamma`` (fp32 weights on fp16 activations give fp32 outputs), ``dx`` the input's dtype,
``mu``/``rsigma`` are fp32. ``memory_efficient=True`` saves the output instead of the input and rebuilds
``x̂ = (z − beta) / gamma`` in the backward. Unlike Apex's, any hidden size works (Apex's CUDA kernels are
compiled for a fixed list from 768 to 65536).
"""

from __future__ import annotations

import torch
from torch.nn import init

from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._norm import autocast_args
from apex.ops.layer_norm import layer_norm_backward, layer_norm_forward

Tensor = torch.Tensor


def _check(x, gamma, beta):
    # Apex's fast_layer_norm.ln_fwd checked the shapes and dtypes below with TORCH_CHECK: those errors are also
    # its RuntimeError.
    for name, t in (("x", x), ("gamma", gamma), ("beta", beta)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if gamma.dim() != 1 or tuple(beta.shape) != tuple(gamma.shape):
        raise RuntimeValueError(f"gamma and beta must be 1-D of the same size, got {list(gamma.shape)} and "
                                f"{list(beta.shape)}")
    if beta.dtype != gamma.dtype:
        raise RuntimeTypeError(f"beta must have gamma's dtype {gamma.dtype}, got {beta.dtype}")
    if x.dim() < 1 or x.shape[-1] != gamma.numel():
        raise RuntimeValueError(f"x must have shape [..., {gamma.numel()}] (the size of gamma), got {list(x.shape)}")


def _forward(x2: Tensor, gamma: Tensor, beta: Tensor, epsilon: float):
    if not epsilon >= 0:  # Apex's ln_fwd: TORCH_CHECK(epsilon >= 0.f)
        raise RuntimeValueError(f"epsilon must be >= 0, got {epsilon!r}")
    # fp32 statistics for half inputs on every path (apex.ops.layer_norm's CPU path normalises an fp32 copy).
    return layer_norm_forward(x2, (gamma.numel(),), gamma, beta, epsilon, gamma.dtype)


def ln_fwd(x: Tensor, gamma: Tensor, beta: Tensor, epsilon: float) -> list[Tensor]:
    """``fast_layer_norm.ln_fwd``: ``[z, mu, rsigma]`` for a ``[rows, hidden]`` input; z in gamma's dtype."""
    _check(x, gamma, beta)
    h = gamma.numel()
    z, mu, rs = _forward(x.reshape(-1, h), gamma, beta, epsilon)
    return [z, mu.float() if mu.dtype != torch.float64 else mu, rs.float() if rs.dtype != torch.float64 else rs]


def ln_bwd(dz: Tensor, x_or_z: Tensor, mu: Tensor | None, rsigma: Tensor, gamma: Tensor, beta: Tensor | None,
           memory_efficient: bool) -> list[Tensor]:
    """``fast_layer_norm.ln_bwd``: ``[dx, dgamma, dbeta, dgamma_part, dbeta_part]`` (the parts are fp32
    ``[1, hidden]`` rows here: the reduction has no cross-CTA partials to expose)."""
    h = gamma.numel()
    if memory_efficient and beta is None:
        raise ValueError("beta is required when memory_efficient=True (x̂ is rebuilt as (z − beta) / gamma)")
    dx, dg, db = layer_norm_backward(dz.reshape(-1, h), mu, rsigma, x_or_z.reshape(-1, h), (h,), gamma,
                                     beta if beta is not None else torch.zeros_like(gamma), memory_efficient,
                                     x_or_z.dtype)
    return [dx, dg, db, dg.float().unsqueeze(0), db.float().unsqueeze(0)]


class FastLayerNormFN(torch.autograd.Function):
    """``FastLayerNormFN.apply(x, gamma, beta, epsilon, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, x, gamma, beta, epsilon, memory_efficient=False):
        _check(x, gamma, beta)
        h = gamma.numel()
        z, mu, rs = _forward(x.reshape(-1, h), gamma, beta, epsilon)
        ctx.x_shape, ctx.x_dtype, ctx.memory_efficient = x.shape, x.dtype, bool(memory_efficient)
        if memory_efficient:
            ctx.save_for_backward(z, gamma, beta, None, rs)
        else:
            ctx.save_for_backward(x.reshape(-1, h), gamma, beta, mu, rs)
        return z.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        v, gamma, beta, mu, rs = ctx.saved_tensors
        h = gamma.numel()
        dx, dg, db = layer_norm_backward(dy.reshape(-1, h), mu, rs, v, (h,), gamma, beta, ctx.memory_efficient,
                                         ctx.x_dtype)
        return dx.view(ctx.x_shape), dg, db, None, None


def _fast_layer_norm(x: Tensor, weight: Tensor, bias: Tensor, epsilon: float, memory_efficient: bool = False
                     ) -> Tensor:
    """Apex's functional form: under autocast the arguments are cast to the autocast dtype first."""
    device_type = x.device.type if isinstance(x, torch.Tensor) else "cpu"
    if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
        args = autocast_args(device_type, x, weight, bias)
        with torch.autocast(device_type=device_type, enabled=False):
            return FastLayerNormFN.apply(*args, epsilon, memory_efficient)
    return FastLayerNormFN.apply(x, weight, bias, epsilon, memory_efficient)


class FastLayerNorm(torch.nn.Module):
    """``FastLayerNorm(hidden_size, eps=1e-5, memory_efficient=False)``: LayerNorm over the last dimension."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, memory_efficient: bool = False):
        super().__init__()
        if isinstance(hidden_size, bool) or not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"hidden_size must be a positive int, got {hidden_size!r}")
        self.epsilon = eps
        self.memory_efficient = memory_efficient
        self.weight = torch.nn.Parameter(torch.empty(hidden_size))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.ones_(self.weight)
        init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return _fast_layer_norm(x, self.weight, self.bias, self.epsilon, self.memory_efficient)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.epsilon}, memory_efficient={self.memory_efficient}"
