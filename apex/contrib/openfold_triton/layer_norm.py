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

from apex.ops.openfold_layer_norm import _lean, backward_checked, check_args, forward_checked, use_kernel


class LayerNormSmallShapeOptImpl(Function):
    @classmethod
    def apply(cls, *args, **kwargs):
        """``Function.apply``, entered through its C++ form outside ``torch.func`` transforms and tracing (the
        Python wrapper unwraps ``torch.func``'s dead wrappers, ~4 µs a call); with nothing to differentiate
        the forward runs alone, without the Function's context and saved tensors. ``torch.compile`` traces
        the Function itself (Dynamo takes ``apply`` of an autograd Function without calling this)."""
        if not kwargs and cls is LayerNormSmallShapeOptImpl:
            # The planned eager Triton path first (apex.ops._openfold_ln_direct): None where this one must run.
            n = len(args)
            out = _lean(*args) if n == 5 else _lean(*args, 1e-5) if n == 4 else None
            if out is not None:
                return out
        if kwargs or len(args) not in (4, 5) or torch._C._are_functorch_transforms_active() \
                or torch.compiler.is_compiling():
            return _py_apply(cls, *args, **kwargs)
        inputs, normalized_shape, weight, bias = args[:4]
        eps = args[4] if len(args) == 5 else 1e-5
        if torch.is_grad_enabled() and torch._C._any_requires_grad(inputs, weight, bias):
            return _c_apply(inputs, normalized_shape, weight, bias, eps, False)
        shape, _, n = check_args(inputs, normalized_shape, weight, bias)
        return forward_checked(inputs, shape, n, weight, bias, eps, use_kernel(inputs, n, False))[0]

    @staticmethod
    def forward(ctx, inputs, normalized_shape, weight, bias, eps=1e-05, _compiling=None):
        # _compiling: False from the eager apply above; None (asked) where Dynamo traces this forward, which
        # must not read apex's backend context (a ContextVar: a graph break).
        shape, _, n = check_args(inputs, normalized_shape, weight, bias, _compiling is False)
        kernel = use_kernel(inputs, n, _compiling)
        y, mean, rstd = forward_checked(inputs, shape, n, weight, bias, eps, kernel)
        ctx.save_for_backward(inputs, weight, bias, mean, rstd)
        ctx.normalized_shape, ctx.n, ctx.kernel = shape, n, kernel
        return y

    @staticmethod
    def backward(ctx, d_y):
        inputs, weight, bias, mean, rstd = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[3])
        # The saved tensors passed check_args in the forward: only grad_output's shape is new.
        # The forward's path (its saved statistics' layout), not a second backend choice.
        dx, dw, db = backward_checked(d_y, inputs, ctx.normalized_shape, ctx.n, weight, bias, mean, rstd, needs,
                                      ctx.kernel)
        return dx, None, dw, db, None, None


# Function.apply's Python wrapper (a plain function: Dynamo, inlining the override above after a graph break,
# cannot resolve super() there) and the C++ Function.apply it ends in.
_py_apply = Function.apply.__func__
_c_apply = super(Function, LayerNormSmallShapeOptImpl).apply


def layer_norm_small_shape(inputs: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None,
                           bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """Function form of :class:`LayerNormSmallShapeOptImpl`."""
    return LayerNormSmallShapeOptImpl.apply(inputs, normalized_shape, weight, bias, eps)
