"""Bias + GELU, tanh approximation (Megatron-LM's ``bias_gelu_impl``):
``y = h/2 · (1 + tanh(√(2/π)(h + 0.044715 h³)))`` with ``h = input + bias``.

Dtype policy: the bias add and the activation in fp32 (fp64 for fp64 inputs), one rounding to the input
dtype; ``dbias`` summed in fp32 and returned in the bias dtype.

Paths, behind the ``apex::bias_gelu_fwd``/``_bwd`` custom ops: CUDA/ROCm tensors one Triton launch each way, the
bias gradient included (``apex._kernels.bias_gelu``); CPU tensors PyTorch's ``gelu``/``gelu_backward``
(``approximate="tanh"``).
"""

from __future__ import annotations

import torch

from apex.ops._dispatch import lazy_module
from apex.ops.bias_swiglu import _check_grad, _contig, _h, _triton, bias_grad, check_args, register_bias_act_ops, rows

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.bias_gelu")


# ----------------------------------------------------------------------------- dispatch (no autograd)
def bias_gelu_forward(input: Tensor, bias: Tensor | None) -> Tensor:
    check_args(input, bias, glu=False)
    return _forward(input, bias)


def _forward(input: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`bias_gelu_forward` on checked arguments (the custom op's: its caller checked them)."""
    if _triton(input):
        y = _kernels().forward(rows(input, input.shape[-1]), _contig(bias), input.dtype)
        return y if input.dim() == 2 else y.view(input.shape)
    h, fresh = _h(input, bias)
    y = torch.ops.aten.gelu_(h, approximate="tanh") if fresh else torch.nn.functional.gelu(h, approximate="tanh")
    return y.to(input.dtype)


def bias_gelu_backward(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
    """The gradient of ``input`` (that of ``bias`` is its sum over the leading dims)."""
    check_args(input, bias, glu=False)
    _check_grad(grad_output, input.shape, input)
    return _backward(grad_output, input, bias)


def _backward(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`bias_gelu_backward` on checked arguments (the backward op's: the forward's tensors, and a
    gradient autograd has given the output's shape)."""
    if _triton(input):
        n = input.shape[-1]
        dx = _kernels().backward(rows(grad_output, n), rows(input, n), _contig(bias), input.dtype)
        return dx if input.dim() == 2 else dx.view(input.shape)
    return _bwd_torch(grad_output, input, bias)


def _bwd_torch(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
    h, _ = _h(input, bias)
    return torch.ops.aten.gelu_backward(grad_output.to(h.dtype), h, approximate="tanh").to(input.dtype)


def bias_gelu_backward_with_bias_grad(grad_output: Tensor, input: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of ``input`` and ``bias`` together: one Triton launch (``dbias`` summed in fp32 from the
    unrounded ``dx``), or PyTorch's ``gelu_backward`` and a fp32 sum on the CPU."""
    check_args(input, bias, glu=False)
    if bias is None:
        raise ValueError("bias must be a tensor to take its gradient, got None")
    _check_grad(grad_output, input.shape, input)
    return _backward_with_bias_grad(grad_output, input, bias)


def _backward_with_bias_grad(grad_output: Tensor, input: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`bias_gelu_backward_with_bias_grad` on checked arguments (as :func:`_backward`)."""
    if _triton(input):
        n = input.shape[-1]
        dx, db = _kernels().backward_with_bias_grad(rows(grad_output, n), rows(input, n), bias.contiguous(),
                                                    input.dtype)
        return (dx if input.dim() == 2 else dx.view(input.shape)), db
    dx = _bwd_torch(grad_output, input, bias)
    return dx, bias_grad(dx, bias)


# ------------------------------------------------------------------------------------------ custom ops
# The ops run the unchecked forms (see bias_swiglu's).
_run = register_bias_act_ops("bias_gelu", _forward, _backward, _backward_with_bias_grad, lambda shape: shape, False,
                             _kernels)
_fwd_op = _run.op
_lean = _run.lean


def bias_gelu(input: Tensor, bias: Tensor | None = None) -> Tensor:
    """Differentiable tanh-approximate GELU of ``input + bias``."""
    out = _lean(input, bias)  # a planned eager Triton call: its checks passed for the same facts
    if out is None:
        check_args(input, bias, glu=False)
        out = _run(input, bias)
    return out
