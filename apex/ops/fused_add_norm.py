"""Residual add fused with RMSNorm / LayerNorm: ``h = input + residual``, ``y = norm(h)``; returns ``(y, h)``.

Pre-norm transformer blocks do ``residual = x + residual; x = norm(residual)`` twice per layer; fusing the
add into the normalisation kernel saves a full write and read of ``h``. ``h`` has the promoted dtype of
``input`` and ``residual`` and is rounded to it before being normalised, so the result equals the unfused
``norm(input + residual)`` in that dtype; ``y`` has the input dtype. The gradient reaching ``input`` and
``residual`` is ``dnorm(dy) + dh`` (``dh``: the gradient of the returned ``h``).

Triton path: one forward launch (reads input and residual, writes ``y`` and ``h``) and the normalisation's
backward with ``dh`` added in the same pass, through the ``apex::fused_add_norm_fwd``/``_bwd`` custom ops.
PyTorch path: ``input + residual`` followed by the normalisation's PyTorch path.
"""

from __future__ import annotations

import torch
from torch._C import _any_requires_grad

from apex.ops import layer_norm as _ln
from apex.ops import rms_norm as _rms
from apex.ops._dispatch import custom_op, eager, lazy_module
from apex.ops._norm import (
    _PLAIN,
    DIRECT,
    KERNEL,
    KERNEL_DTYPES,
    LAUNCHERS,
    _same_device,
    grad_rows,
    kernel_backward,
    launchers,
    prepare,
    rows_view,
    stats_dtype,
    use_kernel,
)
from apex.ops._norm_add_direct import AddNormLean

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels._norm")


def _check_residual(input, residual) -> None:
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"residual must be a torch.Tensor, got {type(residual).__name__}")
    if not residual.is_floating_point():
        raise TypeError(f"residual must be a floating-point tensor, got {residual.dtype}")
    if residual.shape != input.shape:
        raise ValueError(f"residual must have the input's shape {list(input.shape)}, "
                         f"got {list(residual.shape)}")
    if not _same_device(residual, input):
        raise ValueError(f"residual is on {residual.device} but input is on {input.device}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@custom_op("apex::fused_add_norm_fwd", materialize_grads=False, grad_outputs=2)
def _fwd_op(input: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
            normalized_shape: list[int], eps: float, is_rms: bool, memory_efficient: bool
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    kernels = _kernels()
    n = _numel(normalized_shape)
    h_dtype = torch.promote_types(input.dtype, residual.dtype)
    w = weight.contiguous() if weight is not None else None
    b = bias.contiguous() if bias is not None else None
    y, mean, rstd, h = kernels.forward(rows_view(input, n), w, b, eps, input.dtype, is_rms,
                                       rows_view(residual, n), h_dtype, out_like=input)
    if mean is None:
        mean = rstd.new_empty(0)
    return y, h, mean, rstd


@_fwd_op.register_fake
def _(input, residual, weight, bias, normalized_shape, eps, is_rms, memory_efficient):
    m = _numel(input.shape[:input.dim() - len(normalized_shape)])
    sd = stats_dtype(input.dtype)
    h = input.new_empty(input.shape, dtype=torch.promote_types(input.dtype, residual.dtype))
    return input.new_empty(input.shape), h, input.new_empty((0 if is_rms else m,), dtype=sd), \
        input.new_empty((m,), dtype=sd)


@custom_op("apex::fused_add_norm_bwd")
def _bwd_op(grad_y: Tensor, grad_h: Tensor, mean: Tensor | None, rstd: Tensor, input_or_output: Tensor,
            weight: Tensor | None, bias: Tensor | None, normalized_shape: list[int], is_rms: bool,
            memory_efficient: bool, dx_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    kernels = _kernels()
    n = _numel(normalized_shape)
    dx, dw, db = kernels.backward(rows_view(grad_y, n), rows_view(input_or_output, n),
                                  weight.contiguous() if weight is not None else None,
                                  bias.contiguous() if bias is not None else None,
                                  mean if mean is not None and not is_rms else None, rstd, memory_efficient,
                                  is_rms, dx_dtype, rows_view(grad_h, n), out_like=input_or_output)
    # The schema's outputs are tensors: empty ones stand for the absent parameters' gradients.
    return dx, dw if dw is not None else grad_y.new_empty(0), db if db is not None else grad_y.new_empty(0)


@_bwd_op.register_fake
def _(grad_y, grad_h, mean, rstd, input_or_output, weight, bias, normalized_shape, is_rms, memory_efficient,
      dx_dtype):
    return (input_or_output.new_empty(input_or_output.shape, dtype=dx_dtype),
            torch.empty_like(weight) if weight is not None else grad_y.new_empty((0,)),
            torch.empty_like(bias) if bias is not None else grad_y.new_empty((0,)))


def _setup(ctx, inputs, output):
    input, residual, weight, bias, normalized_shape, eps, is_rms, memory_efficient = inputs
    y, h, mean, rstd = output
    ctx.args = (normalized_shape, is_rms, memory_efficient, input.dtype, residual.dtype, h.dtype)
    ctx.save_for_backward(y if memory_efficient else h, weight, bias, mean, rstd)


def _backward(ctx, grad_y, grad_h, grad_mean, grad_rstd):
    v, weight, bias, mean, rstd = ctx.saved_tensors
    normalized_shape, is_rms, memory_efficient, in_dtype, res_dtype, h_dtype = ctx.args
    # The eager path hands None for outputs that did not reach the loss (materialize_grads=False).
    if grad_y is None:
        grad_y = torch.zeros_like(v, dtype=in_dtype)
    if grad_h is None:
        grad_h = torch.zeros_like(v, dtype=h_dtype)
    dh, dw, db = _bwd_op(grad_y, grad_h, mean, rstd, v, weight, bias, normalized_shape, is_rms, memory_efficient,
                         h_dtype)
    # .to only where a dtype differs (the usual call has one dtype: ~0.5 µs a call saved each).
    return (dh if dh.dtype == in_dtype else dh.to(in_dtype), dh if dh.dtype == res_dtype else dh.to(res_dtype),
            dw if weight is not None else None, db if bias is not None else None, None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup)


class _Direct(torch.autograd.Function):
    """The eager path with a gradient, launching the kernels itself (as layer_norm's ``_Direct``): the same
    launches as ``_fwd_op``'s eager call without its function, setup_context and backward-op layers. The
    backward takes ``_bwd_op`` when it builds a graph (a second derivative fails as before) or runs under a
    dispatch mode or on tensor subclasses."""

    @staticmethod
    def forward(ctx, input, residual, weight, bias, normalized_shape, n, eps, is_rms, memory_efficient, h_dtype):
        ctx.set_materialize_grads(False)  # an output outside the loss: None, one zero tensor made below
        kernels = (LAUNCHERS or launchers())[0]
        w = weight.contiguous() if weight is not None else None
        b = bias.contiguous() if bias is not None else None
        if n and input.is_contiguous() and residual.is_contiguous():  # (the usual) their own rows, of stride n
            y, mean, rstd, h = kernels.forward_rows(input, n, input.numel() // n, n, w, b, eps, input.dtype, is_rms,
                                                    residual, n, h_dtype, input)
        else:
            y, mean, rstd, h = kernels.forward(rows_view(input, n), w, b, eps, input.dtype, is_rms,
                                               rows_view(residual, n), h_dtype, input)
        ctx.save_for_backward(y if memory_efficient else h, weight, bias, mean, rstd)
        ctx.args = (normalized_shape, n, is_rms, memory_efficient, input.dtype, residual.dtype, h_dtype)
        return y, h

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        v, weight, bias, mean, rstd = ctx.saved_tensors
        normalized_shape, n, is_rms, memory_efficient, in_dtype, res_dtype, h_dtype = ctx.args
        if grad_y is None:
            grad_y = torch.zeros_like(v, dtype=in_dtype)
        if not kernel_backward(grad_y, grad_h):
            if grad_h is None:
                grad_h = torch.zeros_like(v, dtype=h_dtype)
            dh, dw, db = _bwd_op(grad_y, grad_h, mean, rstd, v, weight, bias, list(normalized_shape), is_rms,
                                 memory_efficient, h_dtype)
        else:
            # No gradient for h (the usual call: only y reaches the loss): the kernel adds none, instead of a
            # zero-filled tensor made and read for it.
            # v (h, or y when memory-efficient) was made contiguous by the forward: its own rows (made so again
            # where a saved-tensor hook gave it back in another layout).
            if not v.is_contiguous():
                v = v.contiguous()
            g, sg = (grad_y, n) if grad_y.is_contiguous() else grad_rows(grad_y, n)  # (grad_rows' usual answer)
            dr, sdr = grad_rows(grad_h, n) if grad_h is not None else (None, 0)
            kernels = (LAUNCHERS or launchers())[0]
            dh, dw, db = kernels.backward_rows(g, sg, v, n, rstd.numel(), n,
                                               weight.contiguous() if weight is not None else None,
                                               bias.contiguous() if bias is not None else None,
                                               None if is_rms else mean, rstd, memory_efficient, is_rms, h_dtype,
                                               dr, sdr, None, v)
        dt = dh.dtype
        return (dh if dt is in_dtype else dh.to(in_dtype), dh if dt is res_dtype else dh.to(res_dtype),
                dw if weight is not None else None, db if bias is not None else None, None, None, None, None, None,
                None)


_direct = super(torch.autograd.Function, _Direct).apply  # the C++ apply, as apex.ops._dispatch's


def _fused_add(input, residual, weight, bias, normalized_shape, eps, is_rms, memory_efficient):
    shape, n, in_dtype, how = prepare(input, normalized_shape, weight, bias, None)
    _check_residual(input, residual)
    res_dtype = residual.dtype
    h_dtype = in_dtype if res_dtype is in_dtype else torch.promote_types(in_dtype, res_dtype)
    # prepare's answer covers the input and parameters: eager, plain tensors, the kernels' dtypes; the residual
    # needs the same (h_dtype is then one of the kernels' dtypes too).
    if (how == DIRECT or how == KERNEL) and type(residual) in _PLAIN and res_dtype in KERNEL_DTYPES:
        if how == DIRECT or (torch.is_grad_enabled() and residual.requires_grad):
            return _direct(input, residual, weight, bias, shape, n, float(eps), is_rms, bool(memory_efficient),
                           h_dtype)
        kernels = (LAUNCHERS or launchers())[0]
        y, _, _, h = kernels.forward(rows_view(input, n), weight.contiguous() if weight is not None else None,
                                     bias.contiguous() if bias is not None else None, float(eps), in_dtype,
                                     is_rms, rows_view(residual, n), h_dtype, out_like=input)
        return y, h
    if use_kernel(input, h_dtype, n, weight, bias, residual):
        # Compiling first (torch.compile cannot trace _any_requires_grad); eager() is False while exporting or
        # tracing, under dispatch modes and torch.func transforms and for tensor subclasses: the registered op.
        if (not torch.compiler.is_compiling() and torch.is_grad_enabled()
                and _any_requires_grad(input, residual, weight, bias) and eager((input, residual, weight, bias))):
            return _direct(input, residual, weight, bias, shape, n, float(eps), is_rms, bool(memory_efficient),
                           h_dtype)
        y, h, _, _ = _fwd_op(input, residual, weight, bias, list(shape), float(eps), is_rms, bool(memory_efficient))
        return y, h
    h = input + residual
    if is_rms:
        y = _rms.rms_norm(h, shape, weight, eps, memory_efficient, out_dtype=input.dtype)
    else:
        y = _ln.layer_norm(h, shape, weight, bias, eps, memory_efficient, out_dtype=input.dtype)
    return y, h


def _general_backward(grad_y, grad_h, v, weight, bias, mean, rstd, shape, is_rms, memory_efficient, h_dtype):
    """The registered backward op, for the lean path's backward where it is needed (``_norm_add_direct``), as
    ``_Direct.backward`` calls it."""
    if grad_h is None:
        grad_h = torch.zeros_like(v, dtype=h_dtype)
    return _bwd_op(grad_y, grad_h, mean, rstd, v, weight, bias, list(shape), is_rms, memory_efficient, h_dtype)


# The planned eager Triton calls (apex.ops._norm_add_direct): ``(y, h)``, or None for the general path.
_lean_rms = AddNormLean(True, _check_residual, _general_backward).run
_lean_ln = AddNormLean(False, _check_residual, _general_backward).run


def fused_add_rms_norm(input: Tensor, residual: Tensor, weight: Tensor | None, normalized_shape,
                       eps: float = 1e-6, memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """``h = input + residual``; returns ``(rms_norm(h) · weight, h)``."""
    out = _lean_rms(input, residual, weight, None, normalized_shape, eps, memory_efficient)
    if out is not None:  # a planned eager Triton call: its checks passed for the same facts
        return out
    return _fused_add(input, residual, weight, None, normalized_shape, eps, True, memory_efficient)


def fused_add_layer_norm(input: Tensor, residual: Tensor, weight: Tensor | None, bias: Tensor | None,
                         normalized_shape, eps: float = 1e-6, memory_efficient: bool = False
                         ) -> tuple[Tensor, Tensor]:
    """``h = input + residual``; returns ``(layer_norm(h) · weight + bias, h)``."""
    out = _lean_ln(input, residual, weight, bias, normalized_shape, eps, memory_efficient)
    if out is not None:  # (as fused_add_rms_norm)
        return out
    return _fused_add(input, residual, weight, bias, normalized_shape, eps, False, memory_efficient)


__all__ = ["fused_add_layer_norm", "fused_add_rms_norm"]
