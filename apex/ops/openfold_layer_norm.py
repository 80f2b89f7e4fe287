"""OpenFold's small-shape LayerNorm: ``y = (x − mean) / sqrt(var + eps) · weight + bias`` over the trailing
``normalized_shape``, with the biased variance.

Dtype policy: statistics in fp32 (fp64 for fp64 inputs), one rounding to the input dtype; the saved
``mean``/``rstd`` are fp32 (the input dtype for fp64), one value per row; ``dweight``/``dbias`` are
accumulated in fp32 and rounded to the parameters' dtype.

Paths: CUDA/ROCm tensors run ``apex._kernels.openfold_layer_norm`` (several short rows per program,
strided 4-D inputs read in place, deterministic two-step ``dweight``/``dbias``); rows longer than
``MAX_N`` and fp64 inputs go to PyTorch there too. CPU tensors run PyTorch's fused
``native_layer_norm`` forward and ``native_layer_norm_backward``. Those take one dtype on CUDA (its kernels
raise "expected scalar type BFloat16 but found Float" for bf16 activations with fp32 parameters): with
mixed dtypes they run in the promoted dtype, and the results are rounded back to each tensor's dtype.
"""

from __future__ import annotations

from math import prod

import torch

from apex import _backend
from apex.ops._norm import _same_device
from apex.ops._openfold_ln_direct import Lean

Tensor = torch.Tensor
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_N = 16384  # mirrors apex._kernels.openfold_layer_norm.MAX_N, without importing Triton here


def check_args(input: Tensor, normalized_shape, weight: Tensor | None, bias: Tensor | None, cache: bool = True
               ) -> tuple[tuple[int, ...], int, int]:
    """Validate the arguments; returns ``(normalized_shape, M rows, N per row)``. ``cache``: False where Dynamo
    may be tracing (the tuple cache below goes by ``id()``, which Dynamo cannot carry into a graph)."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"inputs must be a tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"inputs must be a floating-point tensor, got {input.dtype}")
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    if cache and _INT_TUPLES.get(id(normalized_shape)) is normalized_shape:  # this very tuple, seen to hold ints
        shape = normalized_shape
    else:
        try:
            shape = tuple(int(s) for s in normalized_shape)
        except TypeError:
            raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
                            ) from None
        if cache and type(normalized_shape) is tuple and all(type(s) is int for s in normalized_shape) and \
                len(_INT_TUPLES) < 256:
            _INT_TUPLES[id(normalized_shape)] = normalized_shape
    if not shape or len(shape) > input.dim() or input.shape[input.dim() - len(shape):] != shape:
        raise ValueError(f"normalized_shape {list(shape)} must be a non-empty suffix of the input shape "
                         f"{list(input.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(p).__name__}")
        if p.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(p.shape)}")
        if p.device != input.device:
            raise ValueError(f"{name} is on {p.device}, inputs on {input.device}")
    n = prod(shape)
    return shape, input.numel() // max(n, 1) if n else 0, n


# normalized_shape tuples of exact ints seen before, by identity (a tuple is immutable and, held here, its id
# is not reused): a model passes the same tuple every call, used as given without converting it again.
_INT_TUPLES: dict = {}


def use_kernel(x: Tensor, n: int, compiling: bool | None = None) -> bool:
    """Whether the kernels take ``x``; ``compiling``: ``torch.compiler.is_compiling()`` where the caller knows it
    (None: asked here)."""
    if torch.compiler.is_compiling() if compiling is None else compiling:
        # The backend context cannot be read while Dynamo traces (a ContextVar: a graph break); GPU tensors take
        # the kernels and CPU tensors PyTorch's path, as "auto" chooses.
        if not x.is_cuda:
            return False
    # The input decides the device (select's first tensor): select_tensor, without select's search through
    # the other tensors (two frames a call).
    elif _backend.select_tensor(x) != "triton":
        return False
    return x.dtype in _KERNEL_DTYPES and 0 < n <= _MAX_N


# apex._kernels.openfold_layer_norm once imported (at the first kernel launch: importing apex imports no
# Triton). An ``import`` statement per call costs ~1 µs (importlib's fromlist handling, in Python).
_KERNELS: list = []


def _kernels() -> list:
    if not _KERNELS:
        from apex._kernels import openfold_layer_norm

        _KERNELS.append(openfold_layer_norm)
    return _KERNELS


def _mixed_dtype(*tensors) -> torch.dtype | None:
    """None when the tensors given (None entries skipped) share a dtype, else their promoted dtype (fp32 or
    wider, since any two distinct floating dtypes promote to at least fp32), which PyTorch's path then
    computes in."""
    dts = {t.dtype for t in tensors if t is not None}
    if len(dts) == 1:
        return None
    ct = dts.pop()
    for dt in dts:
        ct = torch.promote_types(ct, dt)
    return ct


def _as(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return t.to(dtype) if t is not None else None


def _kernel_view(x: Tensor, shape) -> Tensor:
    """A view the kernels read in place: strided ≤4-D over the last dim, else contiguous rows."""
    if len(shape) == 1 and x.dim() <= 4:
        return x
    return x.contiguous().view(-1, prod(shape))


def _flat(p: Tensor | None) -> Tensor | None:
    # A 1-D contiguous parameter (the usual one) is already what the kernels read: no reshape (~1.5 µs).
    if p is None or (p.dim() == 1 and p.is_contiguous()):
        return p
    return p.reshape(-1).contiguous()


def layer_norm_forward(input: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
                       eps: float = 1e-5) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, mean, rstd)`` without autograd; ``mean``/``rstd`` have one entry per row."""
    shape, _, n = check_args(input, normalized_shape, weight, bias)
    y, mean, rstd = forward_checked(input, shape, n, weight, bias, eps)
    return y, mean.reshape(-1), rstd.reshape(-1)


def forward_checked(input: Tensor, shape: tuple[int, ...], n: int, weight: Tensor | None, bias: Tensor | None,
                    eps: float, kernel: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`layer_norm_forward` on arguments :func:`check_args` passed (``shape``, ``n`` its answers): the
    autograd Function checks once per call, not once per layer. ``kernel``: :func:`use_kernel`'s answer where the
    caller has it (None: asked here). The statistics hold one entry per row: 1-D from the kernels, shaped
    ``[*leading, 1, ...]`` from PyTorch's path."""
    if use_kernel(input, n) if kernel is None else kernel:
        xv = _kernel_view(input, shape)
        y, mean, rstd = (_KERNELS or _kernels())[0].forward(xv, _flat(weight), _flat(bias), eps)
        # y has xv's shape, which is the input's unless the rows were flattened (a view costs ~5 µs).
        return (y if xv is input else y.view(input.shape)), mean, rstd
    ct = _mixed_dtype(input, weight, bias)
    if ct is None:
        y, mean, rstd = torch.native_layer_norm(input, list(shape), weight, bias, eps)
    else:
        y, mean, rstd = torch.native_layer_norm(input.to(ct), list(shape), _as(weight, ct), _as(bias, ct), eps)
        y = y.to(input.dtype)
    # The statistics as native_layer_norm shapes them ([*leading, 1, ...]; the backward views either form): a
    # flattening view saved by the Function is an alias Dynamo's autograd.Function tracing rejects.
    return y, mean, rstd


def layer_norm_backward(grad_output: Tensor, input: Tensor, normalized_shape, weight: Tensor | None,
                        bias: Tensor | None, mean: Tensor, rstd: Tensor,
                        needs: tuple[bool, bool, bool] = (True, True, True)
                        ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``(dinput, dweight, dbias)`` from the saved row statistics; entries not in ``needs`` are None."""
    shape, _, n = check_args(input, normalized_shape, weight, bias)
    # The kernels read these next to the input: a pointer of another device is an illegal access there.
    for name, t in (("grad_output", grad_output), ("mean", mean), ("rstd", rstd)):
        if not _same_device(t, input):
            raise ValueError(f"{name} is on {t.device}, inputs on {input.device}")
    return backward_checked(grad_output, input, shape, n, weight, bias, mean, rstd, needs)


def backward_checked(grad_output: Tensor, input: Tensor, shape: tuple[int, ...], n: int, weight: Tensor | None,
                     bias: Tensor | None, mean: Tensor, rstd: Tensor, needs: tuple[bool, bool, bool],
                     kernel: bool | None = None) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """:func:`layer_norm_backward` on arguments :func:`check_args` passed (``shape``, ``n`` its answers);
    ``kernel``: the forward's path (None: chosen here)."""
    if grad_output.shape != input.shape:
        raise ValueError(f"grad_output has shape {list(grad_output.shape)}, expected {list(input.shape)}")
    need_dw = needs[1] and weight is not None
    need_db = needs[2] and bias is not None
    if use_kernel(input, n) if kernel is None else kernel:
        xv = _kernel_view(input, shape)
        dy = grad_output.contiguous()
        if xv is not input:
            dy = dy.view(xv.shape)
        dx, dw, db = (_KERNELS or _kernels())[0].backward(dy, xv, _flat(weight), mean, rstd, need_dw, need_db,
                                      weight.dtype if weight is not None else input.dtype,
                                      bias.dtype if bias is not None else input.dtype)
        one_d = len(shape) == 1  # the parameters' gradients already have their shape
        return (None if not needs[0] else dx if xv is input else dx.view(input.shape),
                dw if dw is None or one_d else dw.view(shape), db if db is None or one_d else db.view(shape))
    lead = input.shape[: input.dim() - len(shape)]
    mean, rstd = (s.view(*lead, *([1] * len(shape))) for s in (mean, rstd))
    mask = [needs[0], need_dw, need_db]
    ct = _mixed_dtype(input, grad_output, weight, bias)
    if ct is None:
        return torch.ops.aten.native_layer_norm_backward(grad_output, input, list(shape), mean, rstd, weight,
                                                         bias, mask)
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        grad_output.to(ct), input.to(ct), list(shape), mean.to(ct), rstd.to(ct), _as(weight, ct), _as(bias, ct),
        mask)
    return (_as(dx, input.dtype), _as(dw, weight.dtype) if weight is not None else None,
            _as(db, bias.dtype) if bias is not None else None)


def _kernel_module():
    return (_KERNELS or _kernels())[0]


# The planned eager path of the Triton kernels (apex.ops._openfold_ln_direct): the output, or None where the
# general path (LayerNormSmallShapeOptImpl's) takes the call. Called by LayerNormSmallShapeOptImpl.apply.
_lean = Lean(check_args, backward_checked, _KERNEL_DTYPES, _MAX_N, _kernel_module).run
