"""LayerNorm: ``y = (x − mean) / sqrt(var + eps) · weight + bias`` over the trailing ``normalized_shape``.

Dtype policy: statistics and arithmetic in fp32 (fp64 for fp64 inputs), one rounding to the output dtype,
which is the input dtype by default and the weight dtype for the mixed-dtype variant. The saved ``mean``
and ``rstd`` (Apex's ``invvar``) are fp32 for fp16/bf16 inputs and the input dtype otherwise, one value per
row. ``memory_efficient=True`` saves the output instead of the input and rebuilds
``x̂ = (y − bias) / weight`` in the backward (as Apex does; a zero weight then gives non-finite gradients).

Paths: CUDA/ROCm tensors run the one-pass Triton kernels of ``apex._kernels.layer_norm`` through the
``apex::layer_norm_fwd`` / ``apex::layer_norm_bwd`` custom ops (traceable by ``torch.compile``); CPU
tensors run ``F.layer_norm`` (PyTorch's fused kernel, its own autograd), or ``torch.native_layer_norm`` and
its backward inside the same custom ops when the memory-efficient backward is asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from apex.ops._dispatch import custom_op, lazy_module
from apex.ops._norm import (
    DIRECT,
    EXPORT,
    KERNEL,
    LAUNCHERS,
    TORCH,
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
_kernels = lazy_module("apex._kernels.layer_norm")


def _native_ok(x_dtype, weight, bias) -> bool:
    """PyTorch's CPU kernel takes same-dtype parameters, or fp32 parameters with a half input."""
    dts = {p.dtype for p in (weight, bias) if p is not None}
    return not dts or dts == {x_dtype} or (dts == {torch.float32} and x_dtype in (torch.float16,
                                                                                  torch.bfloat16))


# ---------------------------------------------------------------------------------------------- torch
def _forward_torch(x, shape, weight, bias, eps, out_dtype):
    sd = stats_dtype(x.dtype)
    if sd == x.dtype and out_dtype == x.dtype and _native_ok(x.dtype, weight, bias):
        y, mean, rstd = torch.native_layer_norm(x, list(shape), weight, bias, eps)
    else:
        # Half inputs normalise an fp32 copy: PyTorch's kernel computes in fp32 too but hands back its
        # statistics rounded to the half type, and Apex's are fp32 (its tests check them to 5e-6).
        ct = promote(sd, x.dtype, out_dtype, *(p.dtype if p is not None else None for p in (weight, bias)))
        cast = (lambda p: p.to(ct) if p is not None else None)
        y, mean, rstd = torch.native_layer_norm(x.to(ct), list(shape), cast(weight), cast(bias), eps)
        y = y.to(out_dtype)
    return y, mean.reshape(-1).to(sd), rstd.reshape(-1).to(sd)


def _backward_torch(dy, mean, rstd, v, shape, weight, bias, memory_efficient, dx_dtype):
    k = len(shape)
    lead = v.shape[:v.dim() - k]
    stat_shape = tuple(lead) + (1,) * k
    # fp32 at least: the saved statistics are fp32 for half inputs (as Apex's), and PyTorch's CPU backward
    # takes statistics of its input's dtype; fp32 is also the accumulation Apex's kernel does.
    ct = promote(torch.float32, v.dtype, dy.dtype, *(p.dtype if p is not None else None for p in (weight, bias)))
    cast = (lambda p: p.to(ct) if p is not None else None)
    rstd_c = rstd.reshape(stat_shape).to(stats_dtype(ct))
    if memory_efficient:
        # Rebuild x̂ from the output; hand PyTorch an input whose normalisation with mean 0 and the
        # saved rstd is exactly that x̂.
        x = v.to(ct)
        if bias is not None:
            x = x - bias.to(ct)
        if weight is not None:
            x = x / weight.to(ct)
        x = x / rstd_c.to(ct)
        mean_c = torch.zeros_like(rstd_c)
    else:
        x = v.to(ct)
        mean_c = mean.reshape(stat_shape).to(stats_dtype(ct))
    mask = [True, weight is not None, bias is not None]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(dy.to(ct), x, list(shape), mean_c, rstd_c,
                                                           cast(weight), cast(bias), mask)
    dx = dx.to(dx_dtype)
    dw = dw.to(weight.dtype) if weight is not None else None
    db = db.to(bias.dtype) if bias is not None else None
    return dx, dw, db


# --------------------------------------------------------------------------------- dispatch (no autograd)
def layer_norm_forward(input: Tensor, normalized_shape, weight: Tensor | None = None,
                       bias: Tensor | None = None, eps: float = 1e-5, out_dtype: torch.dtype | None = None
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """``(output, mean, rstd)`` without autograd; ``mean``/``rstd`` have one entry per row."""
    shape, m, n = check_args(input, normalized_shape, weight, bias)
    return _forward(input, shape, n, weight, bias, eps, out_dtype or input.dtype)


def _forward(input, shape, n, weight, bias, eps, out_dtype):
    """:func:`layer_norm_forward` on checked arguments (the custom op's: its callers check them)."""
    if use_kernel(input, out_dtype, n, weight, bias):
        kernels = _kernels()
        y, mean, rstd, _ = kernels.forward(rows_view(input, n), weight.contiguous() if weight is not None
                                           else None, bias.contiguous() if bias is not None else None,
                                           eps, out_dtype, out_like=input)
        return y, mean, rstd
    return _forward_torch(input, shape, weight, bias, eps, out_dtype)


def layer_norm_backward(grad_output: Tensor, mean: Tensor | None, rstd: Tensor, input_or_output: Tensor,
                        normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
                        memory_efficient: bool = False, dx_dtype: torch.dtype | None = None,
                        eps: float | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(grad_input, grad_weight, grad_bias)`` from the saved statistics and input (or output). ``eps``, the
    forward's, keeps the Triton path's rows of two elements accurate (see ``apex._kernels._norm``)."""
    shape, m, n = check_args(input_or_output, normalized_shape, weight, bias)
    if tuple(grad_output.shape) != tuple(input_or_output.shape):
        raise ValueError(f"grad_output has shape {list(grad_output.shape)}, expected "
                         f"{list(input_or_output.shape)}")
    # The kernels read these next to the saved input: a pointer of another device is an illegal access there.
    for name, t in (("grad_output", grad_output), ("mean", mean), ("rstd", rstd)):
        if t is not None and not _same_device(t, input_or_output):
            raise NormShapeError(f"{name} is on {t.device} but input_or_output is on {input_or_output.device}")
    if not memory_efficient and mean is None:
        raise ValueError("mean is required unless memory_efficient=True")
    return _backward_checked(grad_output, mean, rstd, input_or_output, shape, n, weight, bias, memory_efficient,
                             dx_dtype or input_or_output.dtype, eps)


def _backward_checked(grad_output, mean, rstd, input_or_output, shape, n, weight, bias, memory_efficient,
                      dx_dtype, eps):
    """:func:`layer_norm_backward` on checked arguments (the backward op's: the forward's tensors)."""
    if use_kernel(input_or_output, dx_dtype, n, weight, bias, grad_output):
        kernels = _kernels()
        dx, dw, db = kernels.backward(rows_view(grad_output, n), rows_view(input_or_output, n),
                                      weight.contiguous() if weight is not None else None,
                                      bias.contiguous() if bias is not None else None,
                                      _flat(mean) if mean is not None else None, _f32(_flat(rstd)),
                                      memory_efficient, dx_dtype, eps=eps, out_like=input_or_output)
        return dx, dw, db
    return _backward_torch(grad_output, mean, rstd, input_or_output, shape, weight, bias,
                           memory_efficient, dx_dtype)


def _flat(stat: Tensor) -> Tensor:
    # The forward's statistics are 1-D already: no reshape (a view, ~1.5 µs) per call.
    return stat if stat.dim() == 1 else stat.reshape(-1)


# ------------------------------------------------------------------------------------------ custom ops
@custom_op("apex::layer_norm_fwd", materialize_grads=False, grad_outputs=1)
def _fwd_op(input: Tensor, weight: Tensor | None, bias: Tensor | None, normalized_shape: list[int],
            eps: float, memory_efficient: bool, out_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    # Its one caller, layer_norm, checked the arguments (and torch.compile records it after that check).
    return _forward(input, normalized_shape, _numel(normalized_shape), weight, bias, eps, out_dtype)


@_fwd_op.register_fake
def _(input, weight, bias, normalized_shape, eps, memory_efficient, out_dtype):
    m = _numel(input.shape[:input.dim() - len(normalized_shape)])
    sd = stats_dtype(input.dtype)
    return (input.new_empty(input.shape, dtype=out_dtype), input.new_empty((m,), dtype=sd),
            input.new_empty((m,), dtype=sd))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@custom_op("apex::layer_norm_bwd")
def _bwd_op(grad_output: Tensor, mean: Tensor | None, rstd: Tensor, input_or_output: Tensor,
            weight: Tensor | None, bias: Tensor | None, normalized_shape: list[int], memory_efficient: bool,
            dx_dtype: torch.dtype, eps: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    # eps has a default so that graphs compiled before it was passed (AOTAutograd's cache keys on the
    # forward only) still run.
    dx, dw, db = _backward_checked(grad_output, mean, rstd, input_or_output, normalized_shape,
                                   _numel(normalized_shape), weight, bias, memory_efficient, dx_dtype, eps)
    # The schema's outputs are tensors: empty ones stand for the absent parameters' gradients.
    return (dx, dw if dw is not None else grad_output.new_empty(0),
            db if db is not None else grad_output.new_empty(0))


@_bwd_op.register_fake
def _(grad_output, mean, rstd, input_or_output, weight, bias, normalized_shape, memory_efficient, dx_dtype,
      eps=None):
    return (input_or_output.new_empty(input_or_output.shape, dtype=dx_dtype),
            torch.empty_like(weight) if weight is not None else grad_output.new_empty((0,)),
            torch.empty_like(bias) if bias is not None else grad_output.new_empty((0,)))


def _setup(ctx, inputs, output):
    input, weight, bias, normalized_shape, eps, memory_efficient, out_dtype = inputs
    y, mean, rstd = output
    ctx.normalized_shape = normalized_shape
    ctx.memory_efficient = memory_efficient
    ctx.input_dtype = input.dtype
    ctx.eps = eps
    if memory_efficient:
        ctx.save_for_backward(y, weight, bias, None, rstd)
    else:
        ctx.save_for_backward(input, weight, bias, mean, rstd)


def _backward(ctx, grad_y, grad_mean, grad_rstd):
    v, weight, bias, mean, rstd = ctx.saved_tensors
    if grad_y is None:  # the eager path's None (materialize_grads=False): only the statistics were used
        grad_y = torch.zeros_like(v)
    dx, dw, db = _bwd_op(grad_y, mean, rstd, v, weight, bias, ctx.normalized_shape, ctx.memory_efficient,
                         ctx.input_dtype, ctx.eps)
    return (dx, dw if weight is not None else None, db if bias is not None else None,
            None, None, None, None)


_fwd_op.register_autograd(_backward, setup_context=_setup)


# ------------------------------------------------------------------------------------- autograd entry
class _Direct(torch.autograd.Function):
    """The eager Triton path with a gradient, launching the kernels itself (what ``_fwd_op``'s eager call does
    through its function, setup and backward op: the same launches, several µs of Python fewer each way).
    The backward takes ``_bwd_op`` wherever the registered op is needed: a graph for a second derivative
    (its error), a dispatch mode or tensor subclass, a gradient of a dtype the kernels do not take."""

    @staticmethod
    def forward(ctx, input, weight, bias, shape, n, eps, memory_efficient, out_dtype):
        y, mean, rstd, sv = forward_saving_rows(input, n, weight.contiguous() if weight is not None else None,
                                                bias.contiguous() if bias is not None else None, eps, out_dtype,
                                                False)
        if memory_efficient:
            ctx.save_for_backward(y, weight, bias, None, rstd)
        else:
            ctx.save_for_backward(input, weight, bias, mean, rstd)
        # sv: the saved input's row stride when it is its own rows (no rows_view or stride to redo), else 0.
        ctx.args = (shape, n, memory_efficient, input.dtype, eps, sv)
        return y

    @staticmethod
    def backward(ctx, dy):
        v, weight, bias, mean, rstd = ctx.saved_tensors
        shape, n, memory_efficient, dx_dtype, eps, sv = ctx.args
        if not kernel_backward(dy):
            dx, dw, db = _bwd_op(dy, mean, rstd, v, weight, bias, list(shape), memory_efficient, dx_dtype, eps)
        else:
            # grad_rows and saved_rows, the usual answers inline (two frames fewer): a contiguous gradient is its
            # own rows; a saved input that was contiguous (sv == n) and still is: its own rows (a saved-tensor hook
            # may give it back in another layout: saved_rows reads what it is then).
            g, sg = (dy, n) if dy.is_contiguous() else grad_rows(dy, n)
            if memory_efficient or sv != n or not v.is_contiguous():
                v, sv = saved_rows(v, n, memory_efficient, sv)
            # dx is shaped as dy (the output's shape, the input's).
            kernels = (LAUNCHERS or launchers())[0]
            dx, dw, db = kernels.backward_rows(g, sg, v, sv, rstd.numel(), n,
                                               weight.contiguous() if weight is not None else None,
                                               bias.contiguous() if bias is not None else None, mean, rstd,
                                               memory_efficient, False, dx_dtype, None, 0, eps, dy)
        return (dx, dw if weight is not None else None, db if bias is not None else None,
                None, None, None, None, None)


_direct = super(torch.autograd.Function, _Direct).apply  # the C++ apply, as apex.ops._dispatch's


def _general_backward(dy, v, weight, bias, mean, rstd, shape, memory_efficient, dx_dtype, eps):
    """The registered backward op, for the lean path's backward where it is needed (see _norm_direct)."""
    return _bwd_op(dy, mean, rstd, v, weight, bias, list(shape), memory_efficient, dx_dtype, eps)


# The planned eager Triton call (apex.ops._norm_direct): the output, or None for the general path below.
_lean = NormLean(False, _general_backward).run


def layer_norm(input: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, memory_efficient: bool = False, out_dtype: torch.dtype | None = None
               ) -> Tensor:
    """Differentiable LayerNorm; ``out_dtype`` defaults to the input dtype (Apex's mixed variant passes
    the weight dtype)."""
    out = _lean(input, normalized_shape, weight, bias, eps, memory_efficient, out_dtype)
    if out is not None:  # a planned eager Triton call: its checks passed for the same facts
        return out
    return layer_norm_general(input, normalized_shape, weight, bias, eps, memory_efficient, out_dtype)


def layer_norm_general(input: Tensor, normalized_shape, weight: Tensor | None, bias: Tensor | None, eps: float,
                       memory_efficient: bool, out_dtype: torch.dtype | None) -> Tensor:
    """:func:`layer_norm` where its lean path (``_lean``) answered None: checked and routed."""
    shape, n, out_dtype, how = prepare(input, normalized_shape, weight, bias, out_dtype)
    if how == DIRECT:
        return _direct(input, weight, bias, shape, n, float(eps), bool(memory_efficient), out_dtype)
    if how == KERNEL:  # nothing to differentiate: the launcher alone (the registered op's function does this)
        kernels = (LAUNCHERS or launchers())[0]
        return kernels.forward(rows_view(input, n), weight.contiguous() if weight is not None else None,
                               bias.contiguous() if bias is not None else None, float(eps), out_dtype,
                               False, None, None, input)[0]
    # While torch.export traces (torch.onnx.export), PyTorch's own layer_norm: exporters know it (ONNX
    # LayerNormalization) and have no translation for the apex::layer_norm_fwd custom op of the GPU path.
    if how == EXPORT or (how == TORCH and not memory_efficient):
        return _layer_norm_torch(input, shape, weight, bias, eps, out_dtype)
    return _fwd_op(input, weight, bias, list(shape), float(eps), bool(memory_efficient), out_dtype)[0]


def _layer_norm_torch(x, shape, weight, bias, eps, out_dtype):
    if out_dtype == x.dtype and _native_ok(x.dtype, weight, bias):
        return F.layer_norm(x, shape, weight, bias, eps)
    ct = promote(x.dtype, out_dtype, *(p.dtype if p is not None else None for p in (weight, bias)))
    cast = (lambda p: p.to(ct) if p is not None else None)
    return F.layer_norm(x.to(ct), shape, cast(weight), cast(bias), eps).to(out_dtype)


# ------------------------------------------------------------- Apex's ``fused_layer_norm_cuda`` entry points
def forward(input: Tensor, normalized_shape, epsilon: float) -> list[Tensor]:
    """``fused_layer_norm_cuda.forward``: ``[output, mean, invvar]``."""
    return list(layer_norm_forward(input, normalized_shape, None, None, epsilon))


def forward_affine(input: Tensor, normalized_shape, gamma: Tensor, beta: Tensor, epsilon: float
                   ) -> list[Tensor]:
    """``fused_layer_norm_cuda.forward_affine``: ``[output, mean, invvar]``, output in the input dtype."""
    return list(layer_norm_forward(input, normalized_shape, gamma, beta, epsilon))


def forward_affine_mixed_dtypes(input: Tensor, normalized_shape, gamma: Tensor, beta: Tensor,
                                epsilon: float) -> list[Tensor]:
    """``fused_layer_norm_cuda.forward_affine_mixed_dtypes``: output in the dtype of ``gamma``."""
    return list(layer_norm_forward(input, normalized_shape, gamma, beta, epsilon, gamma.dtype))


def backward(dout: Tensor, mean: Tensor | None, invvar: Tensor, input_or_output: Tensor, normalized_shape,
             epsilon: float, memory_efficient: bool = False) -> Tensor:
    """``fused_layer_norm_cuda.backward``: ``grad_input``."""
    return layer_norm_backward(dout, mean, invvar, input_or_output, normalized_shape, None, None,
                               memory_efficient, eps=epsilon)[0]


def backward_affine(dout: Tensor, mean: Tensor | None, invvar: Tensor, input_or_output: Tensor,
                    normalized_shape, gamma: Tensor, beta: Tensor, epsilon: float,
                    memory_efficient: bool = False) -> list[Tensor]:
    """``fused_layer_norm_cuda.backward_affine``: ``[grad_input, grad_gamma, grad_beta]``."""
    return list(layer_norm_backward(dout, mean, invvar, input_or_output, normalized_shape, gamma, beta,
                                    memory_efficient, eps=epsilon))
