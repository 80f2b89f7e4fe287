"""RMSNorm: ``y = x / sqrt(mean(x²) + eps) · weight`` over the trailing ``normalized_shape``.

Dtype policy: statistics and arithmetic in fp32 (fp64 for fp64 inputs), one rounding to the output dtype
(the input dtype, or the weight dtype for the mixed-dtype variant). The saved ``rstd`` (Apex's ``invvar``)
is fp32 for fp16/bf16 inputs and the input dtype otherwise, one value per row. ``memory_efficient=True``
saves the output and rebuilds ``x̂ = y / weight`` in the backward.

Paths, both behind the ``apex::rms_norm_fwd`` / ``apex::rms_norm_bwd`` custom ops: CUDA/ROCm tensors run
the one-pass Triton kernels of ``apex._kernels.rms_norm``; CPU tensors run a short sequence of PyTorch
operators (``vector_norm`` for the statistics and two multiplies forward; PyTorch's fused LayerNorm
backward with a zero mean plus one correction term backward). PyTorch's ``F.rms_norm`` on CPU is not a
fused kernel (it decomposes into ~5 operators forward and ~14 backward) and measured slower. While
``torch.export`` traces (``torch.onnx.export``'s default exporter uses it), ``rms_norm`` records the same math
as standard operators instead of the custom op, so exported graphs (ONNX: ReduceMean, Sqrt, Mul) need no apex.
"""

from __future__ import annotations

import torch

from apex.ops._cpu_norms import row_norms
from apex.ops._dispatch import custom_op, lazy_module
from apex.ops._norm import (
    DIRECT,
    EXPORT,
    KERNEL,
    LAUNCHERS,
    NormShapeError,
    _f32,
    _same_device,
    check_args,
    forward_saving_rows,
    grad_rows,
    kernel_backward,
    launchers,
    prepare,
    promote,
    rows_view,
    saved_rows,
    stats_dtype,
    use_kernel,
)
from apex.ops._norm_direct import NormLean

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.rms_norm")


# ---------------------------------------------------------------------------------------------- torch
def _forward_torch(x, n, weight, eps, out_dtype):
    sd = stats_dtype(x.dtype)
    x2 = x.reshape(-1, n)
    ms = row_norms(x2, sd).square_().div_(max(n, 1))
    rstd = ms.add_(eps).rsqrt_()
    y = torch.mul(x2, rstd.unsqueeze(-1))  # promotes half inputs to fp32
    if weight is not None:
        w = weight.reshape(-1)
        y = y.mul_(w) if promote(y.dtype, w.dtype) == y.dtype else y * w
    return y.to(out_dtype).reshape(x.shape), rstd


def _backward_torch(dy, rstd, v, n, weight, memory_efficient, dx_dtype, eps=None):
    # PyTorch's fused LayerNorm backward with mean 0 gives rstd·(g − mean(g) − x̂·mean(g·x̂)) for
    # g = weight·dy, and Σ dy·x̂ for the weight; RMSNorm's dx lacks the −mean(g) term, so it is added
    # back: three passes over the data instead of the six of an operator-by-operator backward.
    ct = promote(torch.float32, v.dtype, dy.dtype, weight.dtype if weight is not None else None)
    v2 = v.reshape(-1, n).to(ct)
    dy2 = dy.reshape(-1, n).to(ct)
    r = rstd.reshape(-1, 1).to(ct)
    w = weight.reshape(-1).to(ct) if weight is not None else None
    if n < 64:
        # Short rows: adding mean(g) back cancels too much of dx (all of it for one element); use the
        # operator-by-operator form, whose cost does not matter at this size.
        xhat = (v2 / w if w is not None else v2) if memory_efficient else v2 * r
        g = dy2 * w if w is not None else dy2
        if n == 1 and eps is not None:
            # One element: 1 − x̂² (which the general form computes by cancellation) is eps·rstd² exactly.
            dx = g * (eps * r * r * r)
        else:
            c = torch.linalg.vecdot(g, xhat).div_(max(n, 1)).unsqueeze(-1)
            dx = torch.addcmul(g, xhat, c, value=-1).mul_(r)
        dw = torch.linalg.vecdot(dy2, xhat, dim=0) if w is not None else None
    else:
        dx, dw = _backward_long_rows(dy2, v2, r, w, n, memory_efficient)
    dw = dw.to(weight.dtype).reshape(weight.shape) if weight is not None else None
    return dx.to(dx_dtype).reshape(v.shape), dw


def _backward_long_rows(dy2, v2, r, w, n, memory_efficient):
    if memory_efficient:  # an input whose normalisation by the saved rstd is x̂ = y / weight
        x = (v2 / w if w is not None else v2) / r
    else:
        x = v2
    g_mean = (torch.mv(dy2, w) if w is not None else dy2.sum(-1)).div_(max(n, 1)).unsqueeze(-1)
    dx, dw, _ = torch.ops.aten.native_layer_norm_backward(dy2, x, [n], torch.zeros_like(r), r, w, None,
                                                          [True, w is not None, False])
    return dx.add_(g_mean.mul_(r)), dw


# --------------------------------------------------------------------------------- dispatch (no autograd)
def rms_norm_forward(input: Tensor, normalized_shape, weight: Tensor | None = None, eps: float = 1e-5,
                     out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(output, rstd)`` without autograd; ``rstd`` has one entry per row."""
    shape, m, n = check_args(input, normalized_shape, weight)
    return _forward(input, n, weight, eps, out_dtype or input.dtype)


def _forward(input, n, weight, eps, out_dtype):
    """:func:`rms_norm_forward` on checked arguments (the custom op's: its callers check them)."""
    if use_kernel(input, out_dtype, n, weight):
        kernels = _kernels()
        y, rstd, _ = kernels.forward(rows_view(input, n), weight.contiguous() if weight is not None else None,
                                     eps, out_dtype, out_like=input)
        return y, rstd
    return _forward_torch(input, n, weight, eps, out_dtype)


def rms_norm_backward(grad_output: Tensor, rstd: Tensor, input_or_output: Tensor, normalized_shape,
                      weight: Tensor | None = None, memory_efficient: bool = False,
                      dx_dtype: torch.dtype | None = None, eps: float | None = None
                      ) -> tuple[Tensor, Tensor | None]:
    """``(grad_input, grad_weight)`` from the saved ``rstd`` and input (or output). ``eps``, the forward's,
    keeps rows of one element accurate: there ``dx = w·dy·eps·rstd³``, which the general form only reaches by
    cancellation (relative error about 1e-7·x²/eps); without it they take the general form."""
    shape, m, n = check_args(input_or_output, normalized_shape, weight)
    if tuple(grad_output.shape) != tuple(input_or_output.shape):
        raise ValueError(f"grad_output has shape {list(grad_output.shape)}, expected "
                         f"{list(input_or_output.shape)}")
    # The kernels read these next to the saved input: a pointer of another device is an illegal access there.
    for name, t in (("grad_output", grad_output), ("rstd", rstd)):
        if t is not None and not _same_device(t, input_or_output):
            raise NormShapeError(f"{name} is on {t.device} but input_or_output is on {input_or_output.device}")
    return _backward_checked(grad_output, rstd, input_or_output, n, weight, memory_efficient,
                             dx_dtype or input_or_output.dtype, eps)


def _backward_checked(grad_output, rstd, input_or_output, n, weight, memory_efficient, dx_dtype, eps):
    """:func:`rms_norm_backward` on checked arguments (the backward op's: the forward's tensors)."""
    if use_kernel(input_or_output, dx_dtype, n, weight, grad_output):
        kernels = _kernels()
        dx, dw = kernels.backward(rows_view(grad_output, n), rows_view(input_or_output, n),
                                  weight.contiguous() if weight is not None else None,
                                  _f32(rstd if rstd.dim() == 1 else rstd.reshape(-1)), memory_efficient,
                                  dx_dtype, eps=eps, out_like=input_or_output)
        return dx, dw
    return _backward_torch(grad_output, rstd, input_or_output, n, weight, memory_efficient, dx_dtype, eps)


# ------------------------------------------------------------------------------------------ custom ops
def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@custom_op("apex::rms_norm_fwd", materialize_grads=False, grad_outputs=1)
def _fwd_op(input: Tensor, weight: Tensor | None, normalized_shape: list[int], eps: float,
            memory_efficient: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    # Its one caller, rms_norm, checked the arguments (and torch.compile records it after that check).
    return _forward(input, _numel(normalized_shape), weight, eps, out_dtype)


@_fwd_op.register_fake
def _(input, weight, normalized_shape, eps, memory_efficient, out_dtype):
    m = _numel(input.shape[:input.dim() - len(normalized_shape)])
    sd = stats_dtype(input.dtype)
    return input.new_empty(input.shape, dtype=out_dtype), input.new_empty((m,), dtype=sd)


@custom_op("apex::rms_norm_bwd")
def _bwd_op(grad_output: Tensor, rstd: Tensor, input_or_output: Tensor, weight: Tensor | None,
            normalized_shape: list[int], memory_efficient: bool, dx_dtype: torch.dtype,
            eps: float | None = None) -> tuple[Tensor, Tensor]:
    # eps has a default so that graphs compiled before it was passed (AOTAutograd's cache keys on the
    # forward only) still run.
    dx, dw = _backward_checked(grad_output, rstd, input_or_output, _numel(normalized_shape), weight,
                               memory_efficient, dx_dtype, eps)
    return dx, dw if dw is not None else grad_output.new_empty(0)


@_bwd_op.register_fake
def _(grad_output, rstd, input_or_output, weight, normalized_shape, memory_efficient, dx_dtype, eps=None):
    return (input_or_output.new_empty(input_or_output.shape, dtype=dx_dtype),
            torch.empty_like(weight) if weight is not None else grad_output.new_empty((0,)))


def _setup(ctx, inputs, output):
    input, weight, normalized_shape, eps, memory_efficient, out_dtype = inputs
    y, rstd = output
    ctx.normalized_shape = normalized_shape
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype = input.dtype
    ctx.eps = eps
    ctx.save_for_backward(y if memory_efficient else input, weight, rstd)


def _backward(ctx, grad_y, grad_rstd):
    v, weight, rstd = ctx.saved_tensors
    if grad_y is None:  # the eager path's None (materialize_grads=False): only rstd was used
        grad_y = torch.zeros_like(v)
    dx, dw = _bwd_op(grad_y, rstd, v, weight, ctx.normalized_shape, ctx.memory_efficient, ctx.input_dtype,
                     ctx.eps)
    return dx, dw if weight is not None else None, None, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------------------------- autograd entry
class _Direct(torch.autograd.Function):
    """The eager Triton path with a gradient, launching the kernels itself (what ``_fwd_op``'s eager call does
    through its function, setup and backward op: the same launches, ~6 µs of Python fewer each way). The
    backward takes ``_bwd_op`` wherever the registered op is needed: a graph for a second derivative
    (its error), a dispatch mode or tensor subclass, a gradient of a dtype the kernels do not take."""

    @staticmethod
    def forward(ctx, input, weight, shape, n, eps, memory_efficient, out_dtype):
        y, _, rstd, sv = forward_saving_rows(input, n, weight.contiguous() if weight is not None else None, None,
                                             eps, out_dtype, True)
        ctx.save_for_backward(y if memory_efficient else input, weight, rstd)
        # sv: the saved input's row stride when it is its own rows (no rows_view or stride to redo), else 0.
        ctx.args = (shape, n, memory_efficient, input.dtype, eps, sv)
        return y

    @staticmethod
    def backward(ctx, dy):
        v, weight, rstd = ctx.saved_tensors
        shape, n, memory_efficient, dx_dtype, eps, sv = ctx.args
        if not kernel_backward(dy):
            dx, dw = _bwd_op(dy, rstd, v, weight, list(shape), memory_efficient, dx_dtype, eps)
        else:
            # grad_rows and saved_rows, the usual answers inline (two frames fewer): a contiguous gradient is its
            # own rows; a saved input that was contiguous (sv == n) and still is: its own rows (a saved-tensor hook
            # may give it back in another layout: saved_rows reads what it is then).
            g, sg = (dy, n) if dy.is_contiguous() else grad_rows(dy, n)
            if memory_efficient or sv != n or not v.is_contiguous():
                v, sv = saved_rows(v, n, memory_efficient, sv)
            # dx is shaped as dy (the output's shape, the input's).
            kernels = (LAUNCHERS or launchers())[0]
            dx, dw, _ = kernels.backward_rows(g, sg, v, sv, rstd.numel(), n,
                                              weight.contiguous() if weight is not None else None, None, None,
                                              rstd, memory_efficient, True, dx_dtype, None, 0, eps, dy)
        return dx, dw if weight is not None else None, None, None, None, None, None


_direct = super(torch.autograd.Function, _Direct).apply  # the C++ apply, as apex.ops._dispatch's


def _general_backward(dy, v, weight, bias, mean, rstd, shape, memory_efficient, dx_dtype, eps):
    """The registered backward op, for the lean path's backward where it is needed (see _norm_direct)."""
    dx, dw = _bwd_op(dy, rstd, v, weight, list(shape), memory_efficient, dx_dtype, eps)
    return dx, dw, None


# The planned eager Triton call (apex.ops._norm_direct): the output, or None for the general path below.
_lean = NormLean(True, _general_backward).run


def rms_norm(input: Tensor, normalized_shape, weight: Tensor | None = None, eps: float = 1e-5,
             memory_efficient: bool = False, out_dtype: torch.dtype | None = None) -> Tensor:
    """Differentiable RMSNorm; ``out_dtype`` defaults to the input dtype."""
    out = _lean(input, normalized_shape, weight, None, eps, memory_efficient, out_dtype)
    if out is not None:  # a planned eager Triton call: its checks passed for the same facts
        return out
    return rms_norm_general(input, normalized_shape, weight, eps, memory_efficient, out_dtype)


def rms_norm_general(input: Tensor, normalized_shape, weight: Tensor | None, eps: float, memory_efficient: bool,
                     out_dtype: torch.dtype | None) -> Tensor:
    """:func:`rms_norm` where its lean path (``_lean``) answered None: checked and routed."""
    shape, n, out_dtype, how = prepare(input, normalized_shape, weight, None, out_dtype)
    if how == DIRECT:
        return _direct(input, weight, shape, n, float(eps), bool(memory_efficient), out_dtype)
    if how == KERNEL:  # nothing to differentiate: the launcher alone (the registered op's function does this)
        kernels = (LAUNCHERS or launchers())[0]
        return kernels.forward(rows_view(input, n), weight.contiguous() if weight is not None else None, None,
                               float(eps), out_dtype, True, None, None, input)[0]
    if how == EXPORT:
        # torch.export (and so torch.onnx.export's dynamo exporter) records PyTorch's own operators: an
        # exported graph must not depend on apex being importable, and exporters have no translation for
        # apex::rms_norm_fwd. torch.compile keeps the custom op (its fused kernels).
        return _rms_norm_composite(input, shape, weight, float(eps), out_dtype)
    return _fwd_op(input, weight, list(shape), float(eps), bool(memory_efficient), out_dtype)[0]


def _rms_norm_composite(x: Tensor, shape, weight: Tensor | None, eps: float, out_dtype: torch.dtype) -> Tensor:
    """The same math and dtype policy in standard operators only (ONNX: Pow/ReduceMean/Sqrt/Mul)."""
    xs = x.to(stats_dtype(x.dtype))
    dims = list(range(-len(shape), 0))
    y = xs * torch.rsqrt(xs.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    return y.to(out_dtype)


# ------------------------------------------------------------- Apex's ``fused_layer_norm_cuda`` entry points
def rms_forward(input: Tensor, normalized_shape, epsilon: float) -> list[Tensor]:
    """``fused_layer_norm_cuda.rms_forward``: ``[output, invvar]``."""
    return list(rms_norm_forward(input, normalized_shape, None, epsilon))


def rms_forward_affine(input: Tensor, normalized_shape, gamma: Tensor, epsilon: float) -> list[Tensor]:
    """``fused_layer_norm_cuda.rms_forward_affine``: ``[output, invvar]``, output in the input dtype."""
    return list(rms_norm_forward(input, normalized_shape, gamma, epsilon))


def rms_forward_affine_mixed_dtypes(input: Tensor, normalized_shape, gamma: Tensor, epsilon: float
                                   ) -> list[Tensor]:
    """``fused_layer_norm_cuda.rms_forward_affine_mixed_dtypes``: output in the dtype of ``gamma``."""
    return list(rms_norm_forward(input, normalized_shape, gamma, epsilon, gamma.dtype))


def rms_backward(dout: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape, epsilon: float,
                 memory_efficient: bool = False) -> Tensor:
    """``fused_layer_norm_cuda.rms_backward``: ``grad_input``."""
    return rms_norm_backward(dout, invvar, input_or_output, normalized_shape, None, memory_efficient,
                             eps=epsilon)[0]


def rms_backward_affine(dout: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape,
                        gamma: Tensor, epsilon: float, memory_efficient: bool = False) -> list[Tensor]:
    """``fused_layer_norm_cuda.rms_backward_affine``: ``[grad_input, grad_gamma]``."""
    return list(rms_norm_backward(dout, invvar, input_or_output, normalized_shape, gamma, memory_efficient,
                                  eps=epsilon))
