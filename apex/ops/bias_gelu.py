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

from apex._backend import select
from apex.ops.bias_swiglu import _check_grad, _contig, _h, bias_grad, check_args, register_bias_act_ops

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- dispatch (no autograd)
def bias_gelu_forward(input: Tensor, bias: Tensor | None) -> Tensor:
    n = check_args(input, bias, glu=False)
    if input.dtype != torch.float64 and select(input) == "triton":
        from apex._kernels import bias_gelu as kernels

        return kernels.forward(input.reshape(-1, n), _contig(bias), input.dtype).view(input.shape)
    h, fresh = _h(input, bias)
    y = torch.ops.aten.gelu_(h, approximate="tanh") if fresh else torch.nn.functional.gelu(h, approximate="tanh")
    return y.to(input.dtype)


def bias_gelu_backward(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
    """The gradient of ``input`` (that of ``bias`` is its sum over the leading dims)."""
    n = check_args(input, bias, glu=False)
    _check_grad(grad_output, input.shape)
    if input.dtype != torch.float64 and select(input) == "triton":
        from apex._kernels import bias_gelu as kernels

        dx = kernels.backward(grad_output.reshape(-1, n), input.reshape(-1, n), _contig(bias), input.dtype)
        return dx.view(input.shape)
    return _bwd_torch(grad_output, input, bias)


def _bwd_torch(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
    h, _ = _h(input, bias)
    return torch.ops.aten.gelu_backward(grad_output.to(h.dtype), h, approximate="tanh").to(input.dtype)


def bias_gelu_backward_with_bias_grad(grad_output: Tensor, input: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of ``input`` and ``bias`` together: one Triton launch (``dbias`` summed in fp32 from the
    unrounded ``dx``), or PyTorch's ``gelu_backward`` and a fp32 sum on the CPU."""
    n = check_args(input, bias, glu=False)
    if bias is None:
        raise ValueError("bias must be a tensor to take its gradient, got None")
    _check_grad(grad_output, input.shape)
    if input.dtype != torch.float64 and select(input) == "triton":
        from apex._kernels import bias_gelu as kernels

        dx, db = kernels.backward_with_bias_grad(grad_output.reshape(-1, n), input.reshape(-1, n),
                                                 bias.contiguous(), input.dtype)
        return dx.view(input.shape), db
    dx = _bwd_torch(grad_output, input, bias)
    return dx, bias_grad(dx, bias)


# ------------------------------------------------------------------------------------------ custom ops
_fwd_op = register_bias_act_ops("bias_gelu", bias_gelu_forward, bias_gelu_backward, bias_gelu_backward_with_bias_grad,
                                lambda shape: shape)


def bias_gelu(input: Tensor, bias: Tensor | None = None) -> Tensor:
    """Differentiable tanh-approximate GELU of ``input + bias``."""
    check_args(input, bias, glu=False)
    return _fwd_op(input, bias)
