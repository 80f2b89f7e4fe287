"""``LayerNormSmallShapeOptImpl``: OpenFold's LayerNorm as an autograd Function.

``LayerNormSmallShapeOptImpl.apply(inputs, normalized_shape, weight, bias, eps=1e-5)`` computes
``F.layer_norm(inputs, normalized_shape, weight, bias, eps)``. On GPUs it runs apex's small-row Triton
kernels (several rows per program; a 4-D non-contiguous input normalised over its last dim is read in
place, as upstream); on CPUs PyTorch's fused LayerNorm. Statistics are fp32; ``weight``/``bias`` may be
None (upstream requires both). Unlike upstream, non-contiguous inputs of any rank are accepted (those
the kernels cannot read in place are copied once).
"""

from __future__ import annotations

import torch
from torch.autograd import Function

from apex.ops.openfold_layer_norm import check_args, layer_norm_backward, layer_norm_forward


class LayerNormSmallShapeOptImpl(Function):
    @staticmethod
    def forward(ctx, inputs, normalized_shape, weight, bias, eps=1e-05):
        shape, _, _ = check_args(inputs, normalized_shape, weight, bias)
        y, mean, rstd = layer_norm_forward(inputs, shape, weight, bias, eps)
        ctx.save_for_backward(inputs, weight, bias, mean, rstd)
        ctx.normalized_shape = shape
        return y

    @staticmethod
    def backward(ctx, d_y):
        inputs, weight, bias, mean, rstd = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3])
        dx, dw, db = layer_norm_backward(d_y, inputs, ctx.normalized_shape, weight, bias, mean, rstd, needs)
        return dx, None, dw, db, None


def layer_norm_small_shape(inputs: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Function form of :class:`LayerNormSmallShapeOptImpl`."""
    return LayerNormSmallShapeOptImpl.apply(inputs, normalized_shape, weight, bias, eps)
