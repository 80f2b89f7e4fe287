"""Bias + SwiGLU: ``y = silu(x₁ + b₁) · (x₂ + b₂)`` on the two halves of the last dim (Megatron-LM's MLP
activation, ROCm Apex's ``fused_bias_swiglu``).

``input`` ``[..., 2n]``, ``bias`` ``[2n]`` or None, ``y`` ``[..., n]``. Backward:
``dx₂ = dy·silu(h₁)``, ``dx₁ = dy·h₂·σ(h₁)·(1 + h₁(1 − σ(h₁)))``, ``dbias = Σ dx`` over the leading dims
(in the same Triton launch as ``dx`` when the bias needs a gradient).

Dtype policy: the bias add and the activation in fp32 (fp64 for fp64 inputs), one rounding to the input
dtype; the bias may be of any float dtype; ``dbias`` is summed in fp32 and returned in the bias dtype.

Paths, behind the ``apex::bias_swiglu_fwd``/``_bwd`` custom ops: CUDA/ROCm tensors one Triton launch each
way (``apex._kernels.bias_swiglu``); CPU tensors PyTorch's ``silu`` / ``silu_backward`` on the halves.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._C import _any_requires_grad, _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex._backend import select_tensor
from apex.ops._bias_act_direct import Lean
from apex.ops._dispatch import _PLAIN, _PLAIN_OR_NONE, custom_op, lazy_module
from apex.ops._norm import _same_device

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.bias_swiglu")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_args(input: Tensor, bias: Tensor | None, glu: bool = True) -> int:
    """Validate and return the width of the last dim of ``input``."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if input.dim() < 1 or input.dtype not in _FLOATS:
        raise ValueError(f"input must be a float tensor with at least one dim, got {input.dtype} "
                         f"{list(input.shape)}")
    n = input.shape[-1]
    if glu and n % 2:
        raise ValueError(f"input's last dim must be even for SwiGLU (two halves), got {n}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor or None, got {type(bias).__name__}")
        if bias.shape != (n,) or bias.dtype not in _FLOATS:
            raise ValueError(f"bias must be a float tensor of shape [{n}] (input's last dim), got {bias.dtype} "
                             f"{list(bias.shape)}")
        if not _same_device(bias, input):
            raise ValueError(f"bias is on {bias.device} but input is on {input.device}")
    return n


def _contig(bias: Tensor | None) -> Tensor | None:
    """The kernels index the bias with unit stride."""
    return bias.contiguous() if bias is not None else None


def _cd(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _h(x: Tensor, bias: Tensor | None) -> tuple[Tensor, bool]:
    """``x + bias`` in the compute dtype, and whether it is a fresh tensor (safe to overwrite)."""
    cd = _cd(x.dtype)
    if bias is not None:
        return torch.add(x, bias.to(cd)), True  # a half x promotes to fp32 here, no extra copy
    return (x, False) if x.dtype == cd else (x.to(cd), True)


def _fwd_torch(x: Tensor, bias: Tensor | None) -> Tensor:
    # Two half-width temporaries (Megatron's eager form allocates four half widths): (x₂ + b₂) becomes the
    # output and silu(x₁ + b₁) is computed in place in the other.
    cd = _cd(x.dtype)
    n = x.shape[-1] // 2
    x1, x2 = x[..., :n], x[..., n:]
    if bias is None:
        a = F.silu(x1) if x.dtype == cd else F.silu(x1.to(cd), inplace=True)
        return a.mul_(x2).to(x.dtype)
    b = bias.to(cd)
    a = F.silu(torch.add(x1, b[:n]), inplace=True)  # a half x promotes to fp32 here, no extra copy
    return torch.add(x2, b[n:]).mul_(a).to(x.dtype)


def _bwd_torch(dy: Tensor, x: Tensor, bias: Tensor | None) -> Tensor:
    h, _ = _h(x, bias)
    n = h.shape[-1] // 2
    h1, h2 = h[..., :n], h[..., n:]
    d2 = F.silu(h1).mul_(dy)
    d1 = torch.ops.aten.silu_backward(torch.mul(dy, h2), h1)
    return torch.cat((d1, d2), -1).to(x.dtype)


# ----------------------------------------------------------------------------- dispatch (no autograd)
def rows(t: Tensor, n: int) -> Tensor:
    """``t`` as the kernels' 2-D ``[rows, n]`` (any strides): a 2-D tensor as it is, no view per call."""
    return t if t.dim() == 2 else t.reshape(-1, n)


def _triton(input: Tensor) -> bool:
    return input.dtype != torch.float64 and select_tensor(input) == "triton"


def bias_swiglu_forward(input: Tensor, bias: Tensor | None) -> Tensor:
    """``fused_bias_swiglu.forward``: ``silu(x₁ + b₁)·(x₂ + b₂)``, ``[..., n]`` in the input dtype."""
    check_args(input, bias)
    return _forward(input, bias)


def _forward(input: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`bias_swiglu_forward` on checked arguments (the custom op's: its caller checked them)."""
    if _triton(input):
        n = input.shape[-1]
        y = _kernels().forward(rows(input, n), _contig(bias), input.dtype)
        return y if input.dim() == 2 else y.view(*input.shape[:-1], n // 2)
    return _fwd_torch(input, bias)


def _check_grad(grad_output: Tensor, shape: tuple[int, ...], input: Tensor) -> None:
    if not isinstance(grad_output, torch.Tensor) or tuple(grad_output.shape) != tuple(shape):
        raise ValueError(f"grad_output must have shape {list(shape)}, got {list(getattr(grad_output, 'shape', []))}")
    # The kernels read it next to the input: a pointer of another device is an illegal access there.
    if not _same_device(grad_output, input):
        raise ValueError(f"grad_output is on {grad_output.device} but input is on {input.device}")


def bias_swiglu_backward(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
    """``fused_bias_swiglu.backward``: the gradient of ``input`` (that of ``bias`` is its sum over rows)."""
    n = check_args(input, bias)
    _check_grad(grad_output, (*input.shape[:-1], n // 2), input)
    return _backward(grad_output, input, bias)


def _backward(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`bias_swiglu_backward` on checked arguments (the backward op's: the forward's tensors, and a
    gradient autograd has given the output's shape)."""
    if _triton(input):
        n = input.shape[-1]
        dx = _kernels().backward(rows(grad_output, n // 2), rows(input, n), _contig(bias), input.dtype)
        return dx if input.dim() == 2 else dx.view(input.shape)
    return _bwd_torch(grad_output, input, bias)


def bias_swiglu_backward_with_bias_grad(grad_output: Tensor, input: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of ``input`` and ``bias`` together: one Triton launch (the kernel sums ``dbias`` in fp32
    from the unrounded ``dx``), or PyTorch's backward and a fp32 sum on the CPU."""
    n = check_args(input, bias)
    if bias is None:
        raise ValueError("bias must be a tensor to take its gradient, got None")
    _check_grad(grad_output, (*input.shape[:-1], n // 2), input)
    return _backward_with_bias_grad(grad_output, input, bias)


def _backward_with_bias_grad(grad_output: Tensor, input: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`bias_swiglu_backward_with_bias_grad` on checked arguments (as :func:`_backward`)."""
    if _triton(input):
        n = input.shape[-1]
        dx, db = _kernels().backward_with_bias_grad(rows(grad_output, n // 2), rows(input, n), bias.contiguous(),
                                                    input.dtype)
        return (dx if input.dim() == 2 else dx.view(input.shape)), db
    dx = _bwd_torch(grad_output, input, bias)
    return dx, bias_grad(dx, bias)


# ------------------------------------------------------------------------------------------ custom ops
def bias_grad(dx: Tensor, bias: Tensor) -> Tensor:
    """The gradient of a bias added along the last dim: ``dx`` summed over the leading dims in fp32."""
    return torch.sum(dx.reshape(-1, dx.shape[-1]), 0, dtype=torch.float32).to(bias.dtype)


def register_bias_act_ops(name: str, forward: Callable, backward: Callable, backward_with_bias_grad: Callable,
                          out_shape: Callable, glu: bool, kernels: Callable) -> Callable:
    """The custom ops ``apex::<name>_fwd``, ``_bwd`` and ``_bwd_dbias`` over a bias + activation's dispatch
    functions, with fake implementations (``torch.compile``) and the autograd formula, which takes the bias
    gradient from the backward's own launch when the bias needs one. Returns the function a checked call
    takes: the forward op while compiling, exporting or tracing, under a dispatch mode or ``torch.func``
    transform, or for a tensor subclass; otherwise the dispatch functions themselves, inside one plain
    ``autograd.Function`` when a gradient is needed (the custom op's eager call without its layers). Its
    ``lean`` attribute is the call's planned eager Triton path (:class:`apex.ops._bias_act_direct.Lean`, ``glu``
    its activation, ``kernels`` its kernel module's getter), which the entry tries before checking."""

    @custom_op(f"apex::{name}_fwd")
    def fwd(input: Tensor, bias: Tensor | None) -> Tensor:
        return forward(input, bias)

    @fwd.register_fake
    def _(input, bias):
        return input.new_empty(out_shape(input.shape))

    @custom_op(f"apex::{name}_bwd")
    def bwd(grad_output: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
        return backward(grad_output, input, bias)

    @bwd.register_fake
    def _(grad_output, input, bias):
        return torch.empty_like(input, memory_format=torch.contiguous_format)

    @custom_op(f"apex::{name}_bwd_dbias")
    def bwd_dbias(grad_output: Tensor, input: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        return backward_with_bias_grad(grad_output, input, bias)

    @bwd_dbias.register_fake
    def _(grad_output, input, bias):
        return torch.empty_like(input, memory_format=torch.contiguous_format), torch.empty_like(bias)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def autograd_backward(ctx, grad):
        input, bias = ctx.saved_tensors
        if bias is not None and ctx.needs_input_grad[1]:
            return bwd_dbias(grad, input, bias)
        return bwd(grad, input, bias), None

    fwd.register_autograd(autograd_backward, setup_context=setup)

    class Direct(torch.autograd.Function):
        @staticmethod
        def forward(ctx, input, bias):
            ctx.save_for_backward(input, bias)
            return forward(input, bias)

        @staticmethod
        def backward(ctx, grad):
            # The backward ops wherever the registered op is needed: a graph for a second derivative (their
            # error), a dispatch mode, a torch.func transform, a tensor subclass.
            if (torch.is_grad_enabled() or type(grad) not in _PLAIN or torch.compiler.is_compiling()
                    or torch.compiler.is_exporting() or _dispatch_modes() or _are_functorch_transforms_active()
                    or _is_tracing()):
                return autograd_backward(ctx, grad)
            input, bias = ctx.saved_tensors
            if bias is not None and ctx.needs_input_grad[1]:
                return backward_with_bias_grad(grad, input, bias)
            return backward(grad, input, bias), None

    direct = super(torch.autograd.Function, Direct).apply  # the C++ apply, as apex.ops._dispatch's

    def run(input: Tensor, bias: Tensor | None) -> Tensor:
        if (torch.compiler.is_compiling() or torch.compiler.is_exporting() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing() or type(input) not in _PLAIN
                or type(bias) not in _PLAIN_OR_NONE):
            return fwd(input, bias)
        if torch.is_grad_enabled() and _any_requires_grad(input, bias):
            return direct(input, bias)
        return forward(input, bias)

    run.op = fwd  # type: ignore[attr-defined]
    run.lean = Lean(glu, kernels, autograd_backward, (forward, backward, backward_with_bias_grad),  # type: ignore
                    check_args).run
    return run


# The ops run the unchecked forms: their one caller, bias_swiglu, checked the arguments (and torch.compile
# records them after that check); the backward's tensors are the forward's.
_run = register_bias_act_ops("bias_swiglu", _forward, _backward, _backward_with_bias_grad,
                             lambda shape: (*shape[:-1], shape[-1] // 2), True, _kernels)
_fwd_op = _run.op
_lean = _run.lean


# ------------------------------------------------------------------------------------- autograd entry
def bias_swiglu(input: Tensor, bias: Tensor | None = None) -> Tensor:
    """Differentiable ``silu(x₁ + b₁)·(x₂ + b₂)`` over the halves of ``input``'s last dim."""
    out = _lean(input, bias)  # a planned eager Triton call: its checks passed for the same facts
    if out is None:
        check_args(input, bias)
        out = _run(input, bias)
    return out


def swiglu(input: Tensor) -> Tensor:
    """Differentiable ``silu(x₁)·x₂`` over the halves of ``input``'s last dim."""
    return bias_swiglu(input, None)
