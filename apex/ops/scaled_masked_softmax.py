"""Scale-mask-softmax of attention scores: ``y = softmax(scale · x)`` over the last dim, masked keys excluded.

``x`` is ``[b, np, sq, sk]`` (or ``[b·np, sq, sk]``), any strides. ``mask`` (bool or uint8, nonzero = masked)
broadcasts to ``x`` — Megatron's ``[b or 1, 1, sq, sk]`` padding mask, a ``[b, 1, 1, sk]`` key-padding
mask, a full ``[b, np, sq, sk]`` one. ``causal=True`` masks every key ``k > q`` (needs ``sq == sk``). A row
with every key masked gives zeros (Apex's kernel behaviour), never NaN. Backward:
``dx = scale · y · (dy − Σ_k dy·y)``.

Dtype policy: arithmetic in fp32 (fp64 for fp64 inputs), one rounding to the input dtype; outputs are
contiguous. Unlike Apex's CUDA kernels there is no shape limit (any sk, sq, b·np) and fp32 is accepted.

Paths, behind the ``apex::scaled_masked_softmax_fwd`` / ``_bwd`` custom ops: CUDA/ROCm tensors run the
one-launch Triton kernels of ``apex._kernels.scaled_masked_softmax``; CPU tensors (and fp64) run PyTorch's
own operators on one fp32 buffer: upcast, scale, ``masked_fill_`` and ``softmax`` in place, then the cast
back forward; PyTorch's fused softmax backward over the pre-scaled gradient backward.
"""

from __future__ import annotations

import numbers

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex import _backend
from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._dispatch import _PLAIN, custom_op, lazy_module
from apex.ops._norm import _same_device
from apex.ops._softmax_direct import Lean

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.scaled_masked_softmax")

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MASK_DTYPES = (torch.bool, torch.uint8)


# ------------------------------------------------------------------------------------------------ checks
def _shape(t: Tensor) -> list[int]:
    return list(t.shape)


def check_scale(scale: object) -> float:
    if type(scale) is float:  # the usual call: no numbers ABC check
        return scale
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        return float(scale.item())
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        return float(scale)
    raise TypeError(f"scale must be a real number (or a one-element tensor), got {type(scale).__name__}")


def check_args(input: object, mask: object, causal: bool, name: str = "input") -> None:
    """Validate a call; raise ``TypeError``/``ValueError`` naming the argument. Changes nothing."""
    # Apex's *_softmax_cuda extensions checked the dtype and rank (TORCH_CHECK), the mask's shape and a causal
    # gradient's sq == sk (TORCH_INTERNAL_ASSERT): those errors are also its RuntimeError.
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise RuntimeTypeError(f"{name} must be a floating-point tensor (float32, float16, bfloat16 or float64), "
                               f"got {input.dtype}")
    shape = input.shape  # (read once: each .shape or .dim() is a call; Megatron's causal entry checks every call)
    if len(shape) not in (3, 4):
        raise RuntimeValueError(f"{name} must be a 4-D [b, np, sq, sk] (or 3-D [b*np, sq, sk]) tensor of "
                                f"attention scores, got shape {_shape(input)}")
    if causal and shape[-2] != shape[-1]:
        raise RuntimeValueError(f"causal (upper-triangular) masking is for self-attention and needs sq == sk, "
                                f"got {name} of shape {_shape(input)}")
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype not in MASK_DTYPES:
        raise TypeError(f"mask must be a bool (or uint8) tensor, True = masked, got {mask.dtype}")
    if not _same_device(mask, input):
        raise ValueError(f"mask is on {mask.device} but {name} is on {input.device}")
    if not _broadcasts(mask.shape, shape):
        raise RuntimeValueError(f"mask of shape {_shape(mask)} does not broadcast to {name} of shape "
                                f"{_shape(input)} (expected [b or 1, 1 or np, sq or 1, sk or 1])")


def _broadcasts(mshape: torch.Size, shape: torch.Size) -> bool:
    """Whether a mask of ``mshape`` broadcasts to ``shape`` (a loop, not all(<generator>): asked every call)."""
    k = len(mshape)
    if k > len(shape):
        return False
    off = len(shape) - k
    for i in range(k):
        m = mshape[i]
        if m != 1 and m != shape[off + i]:
            return False
    return True


def _check_like(grad_output: Tensor, softmax_results: Tensor) -> None:
    """The gradient's shape and device are the saved output's."""
    if grad_output.shape != softmax_results.shape:
        raise ValueError(f"grad_output has shape {_shape(grad_output)}, expected the shape of softmax_results "
                         f"{_shape(softmax_results)}")
    # The kernel reads both: a pointer of another device is an illegal access there.
    if not _same_device(grad_output, softmax_results):
        raise ValueError(f"grad_output is on {grad_output.device} but softmax_results is on "
                         f"{softmax_results.device}")


def _as4d(t: Tensor) -> Tensor:
    return t.unsqueeze(1) if t.dim() == 3 else t


def _mask4d(mask: Tensor | None, shape) -> Tensor | None:
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(*shape)


def _use_kernel(*tensors: Tensor) -> bool:
    if _backend.select_tensor(tensors[0]) != "triton":
        return False
    for t in tensors:  # a loop, not all(<generator>): asked on every call
        if t.dtype not in KERNEL_DTYPES:
            return False
    return True


# ----------------------------------------------------------------------------------------------- torch
def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _forward_torch(x: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    ct = _compute_dtype(x.dtype)
    # One fp32 buffer, reused by every step: on the CPU first-touching fresh memory costs as much as a pass
    # over it, so the upcast, the scale, the masks and the softmax all write into ``s``.
    s = torch.empty(x.shape, dtype=ct, device=x.device).copy_(x)
    if scale != 1.0:
        s.mul_(scale)
    dead = None
    if causal:
        sq, sk = x.shape[-2:]
        tri = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu_(1)
        s.masked_fill_(tri, float("-inf"))
    if mask is not None:
        m = mask if mask.dtype == torch.bool else mask != 0
        s.masked_fill_(m, float("-inf"))
        # Rows with every key masked: softmax gives NaN there, Apex's kernels give zeros.
        dead = (m | tri).all(-1) if causal else m.all(-1)
    if s.device.type == "cpu":
        # PyTorch's CPU kernel works row by row (max, then exp and sum, then normalise): writing over the
        # input is safe there, and saves first-touching another fp32 buffer.
        torch._softmax(s, -1, False, out=s)
    else:
        s = torch.softmax(s, -1)
    if dead is not None and bool(dead.any()):
        s.masked_fill_(dead.unsqueeze(-1), 0.0)
    return s.to(x.dtype)


def _backward_torch(dy: Tensor, y: Tensor, scale: float, out_dtype: torch.dtype) -> Tensor:
    ct = _compute_dtype(dy.dtype, y.dtype)
    # The scale goes into dy (the backward is linear in dy); on the CPU PyTorch's fused softmax backward
    # then writes dx over it (it reduces Σ dy·y of a row before writing the row).
    g = torch.empty(dy.shape, dtype=ct, device=dy.device).copy_(dy)
    if scale != 1.0:
        g.mul_(scale)
    if g.device.type == "cpu":
        torch._softmax_backward_data(g, y.to(ct), -1, ct, grad_input=g)
    else:
        g = torch._softmax_backward_data(g, y.to(ct), -1, ct)
    return g.to(out_dtype)


# --------------------------------------------------------------------------------- dispatch (no autograd)
def scaled_masked_softmax_forward(input: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                                  causal: bool = False, *, max_block: int | None = None) -> Tensor:
    """Probabilities of ``input`` (3-D or 4-D), without autograd; contiguous, in ``input.dtype``.

    ``max_block`` (Triton path only) caps the keys held in one block; longer rows take the online path.
    """
    check_args(input, mask, causal)
    return _forward_checked(input, mask, check_scale(scale), causal, max_block)


def _forward_checked(input: Tensor, mask: Tensor | None, scale: float, causal: bool, max_block: int | None = None
                     ) -> Tensor:
    """:func:`scaled_masked_softmax_forward` on checked arguments (the custom op's: its callers check)."""
    x = _as4d(input)
    if _use_kernel(x):
        kernels = _kernels()
        y = kernels.forward(x, mask, scale, causal, max_block)  # (reads a broadcast mask through zero strides)
    else:
        y = _forward_torch(x, _mask4d(mask, x.shape), scale, causal)
    # A 4-D input's result already has its shape: no view (a torch.Size argument costs ~5 µs to parse).
    return y if input.dim() == 4 else y.view(input.shape)


def scaled_masked_softmax_backward(grad_output: Tensor, softmax_results: Tensor, scale: float = 1.0,
                                   causal: bool = False, out_dtype: torch.dtype | None = None, *,
                                   max_block: int | None = None) -> Tensor:
    """``scale · y · (dy − Σ dy·y)``, contiguous, in ``out_dtype`` (default: ``grad_output.dtype``).

    ``causal=True`` promises that ``y`` is zero above the diagonal, which the kernel then does not read.
    """
    check_args(softmax_results, None, causal, "softmax_results")
    check_args(grad_output, None, False, "grad_output")
    _check_like(grad_output, softmax_results)
    return _backward_checked(grad_output, softmax_results, check_scale(scale), causal,
                             out_dtype or grad_output.dtype, max_block)


def _backward_checked(grad_output: Tensor, softmax_results: Tensor, scale: float, causal: bool,
                      out_dtype: torch.dtype, max_block: int | None = None) -> Tensor:
    """:func:`scaled_masked_softmax_backward` on checked arguments (the backward op's)."""
    dy, y = _as4d(grad_output), _as4d(softmax_results)
    if _use_kernel(dy, y) and out_dtype in KERNEL_DTYPES:
        kernels = _kernels()
        dx = kernels.backward(dy, y, scale, causal, out_dtype, max_block)
    else:
        dx = _backward_torch(dy, y, scale, out_dtype)
    return dx if softmax_results.dim() == 4 else dx.view(softmax_results.shape)


# ------------------------------------------------------------------------------------------ custom ops
@custom_op("apex::scaled_masked_softmax_fwd")
def _fwd_op(input: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    # Its callers (scaled_masked_softmax, the compiled-extension entry points) checked the arguments.
    return _forward_checked(input, mask, scale, causal)


@_fwd_op.register_fake
def _(input, mask, scale, causal):
    return input.new_empty(input.shape)


@custom_op("apex::scaled_masked_softmax_bwd")
def _bwd_op(grad_output: Tensor, softmax_results: Tensor, scale: float, causal: bool,
            out_dtype: torch.dtype) -> Tensor:
    # Its callers (the op's backward, the compiled-extension entry point) checked the arguments.
    return _backward_checked(grad_output, softmax_results, scale, causal, out_dtype)


@_bwd_op.register_fake
def _(grad_output, softmax_results, scale, causal, out_dtype):
    return softmax_results.new_empty(softmax_results.shape, dtype=out_dtype)


def _setup(ctx, inputs, output):
    input, mask, scale, causal = inputs
    ctx.scale, ctx.causal, ctx.input_dtype = scale, causal, input.dtype
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    dx = _bwd_op(grad, y, ctx.scale, ctx.causal, ctx.input_dtype)
    return dx, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------------------------- autograd entry
class _Direct(torch.autograd.Function):
    """The eager Triton path with a gradient, launching the kernels itself: what ``_fwd_op``'s eager call does
    through its function, setup and backward op, without those layers. The backward takes ``_bwd_op`` wherever
    the registered op is needed: a graph for a second derivative (its error), a dispatch mode or tensor
    subclass, a gradient of a dtype the kernels do not take."""

    @staticmethod
    def forward(ctx, input, mask, scale, causal):
        y = _kernels().forward(input if input.dim() == 4 else input.unsqueeze(1), mask, scale, causal)
        if input.dim() != 4:
            y = y.view(input.shape)
        ctx.save_for_backward(y)
        ctx.args = (scale, causal, input.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        scale, causal, dx_dtype = ctx.args
        # apex.ops._dispatch.eager's tests on dy, inlined (asked on every backward).
        if (torch.is_grad_enabled() or dy.dtype not in KERNEL_DTYPES or type(dy) not in _PLAIN
                or torch.compiler.is_compiling() or torch.compiler.is_exporting() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing()):
            return _bwd_op(dy, y, scale, causal, dx_dtype), None, None, None
        if y.dim() == 4:
            return _kernels().backward(dy, y, scale, causal, dx_dtype), None, None, None
        return _kernels().backward(dy.unsqueeze(1), y.unsqueeze(1), scale, causal, dx_dtype).view(y.shape), None, \
            None, None


_direct = super(torch.autograd.Function, _Direct).apply  # the C++ apply, as apex.ops._dispatch's


def _run(input: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    # The registered op, except in eager mode on plain tensors with the kernels: there the plain Function (a
    # gradient needed) or the launcher alone (the custom op's eager call without its wrapper). Eager mode: not
    # compiling, exporting or tracing, no dispatch mode or torch.func transform, no tensor subclass.
    if not (torch.compiler.is_compiling() or torch.compiler.is_exporting() or _dispatch_modes()
            or _are_functorch_transforms_active() or _is_tracing() or type(input) not in _PLAIN
            or mask is not None and type(mask) not in _PLAIN or input.dtype not in KERNEL_DTYPES
            or _backend.select_tensor(input) != "triton"):
        if torch.is_grad_enabled() and input.requires_grad:
            return _direct(input, mask, scale, causal)
        y = _kernels().forward(input if input.dim() == 4 else input.unsqueeze(1), mask, scale, causal)
        return y if input.dim() == 4 else y.view(input.shape)
    return _fwd_op(input, mask, scale, causal)


# The planned eager Triton path (apex.ops._softmax_direct), tried first: a hit's checks passed for the same facts.
_lean = Lean(_kernels, check_args, check_scale, _bwd_op).run


def scaled_masked_softmax(input: Tensor, mask: Tensor | None = None, scale: float = 1.0,
                          causal: bool = False) -> Tensor:
    """Differentiable ``softmax(scale · input)`` over the last dim with ``mask`` (True = masked) and/or the
    causal mask; fully masked rows give zeros. Output contiguous, in ``input.dtype``."""
    out = _lean(input, mask, scale, causal, False)
    if out is None:
        check_args(input, mask, causal)
        out = _run(input, mask, check_scale(scale), bool(causal))
    return out


def scaled_masked_softmax_checked(input: Tensor, mask: Tensor | None, scale: float, causal: bool) -> Tensor:
    """:func:`scaled_masked_softmax` on ``input`` and ``mask`` that :func:`check_args` passed (with the same
    ``causal``): for callers that check them first (``apex.transformer.functional``), not twice."""
    out = _lean(input, mask, scale, causal, True)
    return out if out is not None else _run(input, mask, check_scale(scale), bool(causal))


# ------------------------------------------ Apex's compiled-extension entry points (positional signatures)
def _compat_forward(input, mask, scale, causal, rank, module):
    if isinstance(input, torch.Tensor) and input.dim() != rank:
        raise RuntimeValueError(f"{module}.forward: input must be a {rank}-D tensor, got shape {_shape(input)}")
    if isinstance(mask, torch.Tensor) and mask.dim() != 4:
        raise RuntimeValueError(f"{module}.forward: mask must be a 4-D [b or 1, 1, sq, sk] tensor, got shape "
                                f"{_shape(mask)}")
    check_args(input, mask, causal)
    # Like the compiled kernels, the result carries no autograd history.
    with torch.no_grad():
        return _fwd_op(input, mask, check_scale(scale), causal)


def _compat_backward(output_grads, softmax_results, scale, causal, rank, module):
    for name, t in (("output_grads", output_grads), ("softmax_results", softmax_results)):
        if isinstance(t, torch.Tensor) and t.dim() != rank:
            raise RuntimeValueError(f"{module}.backward: {name} must be a {rank}-D tensor, got shape {_shape(t)}")
    check_args(softmax_results, None, causal, "softmax_results")
    check_args(output_grads, None, False, "output_grads")
    _check_like(output_grads, softmax_results)
    with torch.no_grad():
        return _bwd_op(output_grads, softmax_results, check_scale(scale), causal, output_grads.dtype)


def masked_softmax_forward(input: Tensor, mask: Tensor, scale) -> Tensor:
    """``scaled_masked_softmax_cuda.forward``: 4-D scores, 4-D mask ``[b or 1, 1, sq, sk]``."""
    return _compat_forward(input, mask, scale, False, 4, "scaled_masked_softmax_cuda")


def masked_softmax_backward(output_grads: Tensor, softmax_results: Tensor, scale) -> Tensor:
    """``scaled_masked_softmax_cuda.backward``."""
    return _compat_backward(output_grads, softmax_results, scale, False, 4, "scaled_masked_softmax_cuda")


def softmax_forward(input: Tensor, scale) -> Tensor:
    """``scaled_softmax_cuda.forward``: 4-D scores, no mask."""
    return _compat_forward(input, None, scale, False, 4, "scaled_softmax_cuda")


def softmax_backward(output_grads: Tensor, softmax_results: Tensor, scale) -> Tensor:
    """``scaled_softmax_cuda.backward``."""
    return _compat_backward(output_grads, softmax_results, scale, False, 4, "scaled_softmax_cuda")


def upper_triang_forward(input: Tensor, scale) -> Tensor:
    """``scaled_upper_triang_masked_softmax_cuda.forward``: 3-D ``[b·np, sq, sk]`` scores, causal mask."""
    return _compat_forward(input, None, scale, True, 3, "scaled_upper_triang_masked_softmax_cuda")


def upper_triang_backward(output_grads: Tensor, softmax_results: Tensor, scale) -> Tensor:
    """``scaled_upper_triang_masked_softmax_cuda.backward``."""
    return _compat_backward(output_grads, softmax_results, scale, True, 3,
                            "scaled_upper_triang_masked_softmax_cuda")


def generic_forward(input: Tensor, mask: Tensor, scale) -> Tensor:
    """``generic_scaled_masked_softmax_cuda.forward`` (any sk)."""
    return _compat_forward(input, mask, scale, False, 4, "generic_scaled_masked_softmax_cuda")


def generic_backward(output_grads: Tensor, softmax_results: Tensor, scale) -> Tensor:
    """``generic_scaled_masked_softmax_cuda.backward``."""
    return _compat_backward(output_grads, softmax_results, scale, False, 4, "generic_scaled_masked_softmax_cuda")


def get_batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    """``scaled_masked_softmax_cuda.get_batch_per_block``: rows per 128-thread block of Apex's CUDA kernel
    (32-lane warps; two rows per warp up to 128 keys). Only a hint here: our kernels take any shape."""
    p2 = 1 << max(0, int(key_seq_len) - 1).bit_length()
    warp_size = min(p2, 32)
    batches_per_warp = 2 if p2 <= 128 else 1
    return (128 // warp_size) * batches_per_warp
