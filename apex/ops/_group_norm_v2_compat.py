"""Apex's ``group_norm_v2_cuda`` (``gn``/``gn_bwd``) with its signatures, over :mod:`apex.ops.group_norm`.

``gn(x, w, b, eps, silu, num_groups, mean_var_out=None, sm_margin=0)`` returns GroupNorm (then SiLU with
``silu``) of ``x`` ``[N, C, H, W]``; ``mean_var_out`` (fp32, ``2·N·G`` values), when given, receives
``(mean, biased_var)`` per ``(n, group)``, Apex's layout, which ``gn_bwd(grad_output, x, w, b, mean_var,
eps, silu, num_groups, sm_margin=0)`` reads back to return ``(dx, dw, db)``. ``sm_margin`` (SMs left free
for overlapping kernels) is accepted and has no effect. Unlike Apex (fp16/bf16 channels_last CUDA only),
fp32 and any memory format work too; statistics are fp32 either way.
"""

from __future__ import annotations

import torch

from apex.ops import group_norm as gn_ops

Tensor = torch.Tensor


def _check(x: Tensor, w: Tensor, b: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(f"x must be a 4-D tensor [N, C, H, W], got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(w, Tensor) or not isinstance(b, Tensor) or w.dtype != b.dtype:
        raise ValueError("gn dtype mismatch: w and b must be tensors of one dtype")


def gn(x: Tensor, w: Tensor, b: Tensor, eps: float, silu: bool, num_groups: int,
       mean_var_out: Tensor | None = None, sm_margin: int = 0) -> Tensor:
    """``group_norm_v2_cuda.gn``: group norm of NHWC ``x`` (optionally followed by SiLU); writes the fp32
    ``(mean, biased variance)`` pair of every (sample, group) into ``mean_var_out`` when given."""
    _check(x, w, b)
    ng = x.shape[0] * num_groups
    if mean_var_out is not None and (mean_var_out.dtype != torch.float32 or mean_var_out.numel() != 2 * ng):
        raise ValueError(f"mean_var_out must be a float32 tensor of 2·N·G = {2 * ng} values, got "
                         f"{mean_var_out.dtype} with {mean_var_out.numel()}")
    y, mean, rstd = gn_ops.group_norm_forward(x, num_groups, w, b, eps, "silu" if silu else "")
    if mean_var_out is not None:
        mean = mean.reshape(-1).to(torch.float32)
        var = rstd.reshape(-1).to(torch.float32).pow(-2) - eps
        with torch.no_grad():
            mean_var_out.view(ng, 2).copy_(torch.stack([mean, var.clamp_min(0)], -1))
    return y


def gn_bwd(grad_output: Tensor, x: Tensor, w: Tensor, b: Tensor, mean_var: Tensor, eps: float, silu: bool,
           num_groups: int, sm_margin: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``group_norm_v2_cuda.gn_bwd``: ``(dx, dw, db)`` from the forward's ``mean_var`` pairs."""
    _check(x, w, b)
    if grad_output.dtype != x.dtype or mean_var.dtype != torch.float32:
        raise ValueError("gn_bwd dtype mismatch: grad_output must have x's dtype and mean_var be float32")
    pairs = mean_var.reshape(-1, 2)
    rstd = torch.rsqrt(pairs[:, 1] + eps)
    dx, dw, db = gn_ops.group_norm_backward(grad_output, x, pairs[:, 0], rstd, num_groups, w, b,
                                            "silu" if silu else "")
    return dx, dw, db
