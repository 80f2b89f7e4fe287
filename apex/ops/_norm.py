"""Argument checks and small helpers shared by the LayerNorm and RMSNorm operations."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch
from torch._C import _any_requires_grad, _are_functorch_transforms_active, _get_tracing_state
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex import _backend
from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._checks import member_set

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLAIN = member_set(torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = member_set(torch.Tensor, torch.nn.Parameter, type(None))
# Widest row the one-pass kernels hold in one block; wider rows take the PyTorch operator.
MAX_FUSED_N = 65536


# Tensors whose shapes (or devices) do not fit the normalisation, and non-floating-point tensors: a
# ValueError / TypeError naming the argument that is also the RuntimeError of PyTorch's and Apex's kernels.
# The classes are apex._errors' pairs; the former names stay importable from here.
NormShapeError = RuntimeValueError
NormDtypeError = RuntimeTypeError


def as_shape(normalized_shape: object) -> tuple[int, ...]:
    """``normalized_shape`` (an int, a sequence of ints or a ``torch.Size``) as a tuple of ints."""
    kind = type(normalized_shape)
    # Checked on every call: plain ints, tuples, lists and torch.Size first, in one loop over the sizes
    # (no numbers ABCs, no all(<generator>), no min()); anything else or a bad size takes _as_shape_slow.
    if kind is int:
        shape = (normalized_shape,)
    elif kind is tuple or kind is list or kind is torch.Size:
        shape = tuple(normalized_shape)
    else:
        return _as_shape_slow(normalized_shape)
    for s in shape:
        if type(s) is not int or s < 0:
            return _as_shape_slow(normalized_shape)
    if not shape:
        return _as_shape_slow(normalized_shape)
    return shape


def _as_shape_slow(normalized_shape: object) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        shape = (int(normalized_shape),)
    elif isinstance(normalized_shape, Sequence) and all(isinstance(s, numbers.Integral) for s in normalized_shape):
        shape = tuple(int(s) for s in normalized_shape)
    else:
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    # Apex's extension threw std::runtime_error (a RuntimeError) for both.
    if not shape:
        raise RuntimeValueError("normalized_shape must have at least one dimension, got []")
    if min(shape) < 0:
        raise RuntimeValueError(f"normalized_shape must hold non-negative sizes, got {list(shape)}")
    return shape


def _same_device(p: torch.Tensor, input: torch.Tensor) -> bool:
    # Two CUDA (or two CPU) tensors compare by flags and index: no torch.device objects built (~1 µs each).
    on_cuda = p.is_cuda
    if on_cuda != input.is_cuda:
        return False
    if on_cuda:
        return p.get_device() == input.get_device()
    return p.is_cpu and input.is_cpu or p.device == input.device


def check_devices(ref: torch.Tensor, *named: tuple[str, object], what: str = "input", error: type = ValueError,
                  optional: bool = False, note: str = "") -> None:
    """Refuse the first ``(name, tensor)`` not on ``ref``'s device, naming it (``"{name} is on ... but {what} is
    on ...{note}"``, raised as ``error``): a Triton kernel would read its pointer as a device address, an illegal
    access. ``optional``: None entries are skipped; otherwise a non-tensor is a ``TypeError``."""
    for name, t in named:
        if t is None and optional:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not _same_device(t, ref):
            raise error(f"{name} is on {t.device} but {what} is on {ref.device}{note}")


def _check_param(name: str, p: object, shape: tuple[int, ...], input: torch.Tensor) -> None:
    if not isinstance(p, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(p).__name__}")
    if not p.is_floating_point():
        raise NormDtypeError(f"{name} must be a floating-point tensor, got {p.dtype}")
    if p.shape != shape:
        raise NormShapeError(f"{name} must have shape {list(shape)} (the normalized_shape), got {list(p.shape)}")
    if not _same_device(p, input):
        raise NormShapeError(f"{name} is on {p.device} but input is on {input.device}")


def check_args(input: object, normalized_shape: object, weight: object = None, bias: object = None
               ) -> tuple[tuple[int, ...], int, int]:
    """Validate a normalisation call; return ``(normalized_shape, rows, row_length)``."""
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    if not input.is_floating_point():
        raise NormDtypeError("input must be a floating-point tensor (float32, float16, bfloat16 or float64), "
                             f"got {input.dtype}")
    shape = as_shape(normalized_shape)
    ishape = input.shape
    k = len(shape)
    if k == 1:  # the usual case: one size to compare, no torch.Size slices
        n = shape[0]
        if not ishape or ishape[-1] != n:
            _shape_error(shape, input)
    else:
        n = math.prod(shape)
        if len(ishape) < k or ishape[len(ishape) - k:] != shape:
            _shape_error(shape, input)
    # Each parameter's checks in a call of their own only when it is there (no (name, tensor) pairs built).
    if weight is not None:
        _check_param("weight", weight, shape, input)
    if bias is not None:
        _check_param("bias", bias, shape, input)
    return shape, input.numel() // n if n else math.prod(ishape[:len(ishape) - k]), n


def _shape_error(shape: tuple[int, ...], input: torch.Tensor) -> None:
    raise NormShapeError(f"normalized_shape={list(shape)} expects an input of shape "
                         f"[*, {', '.join(map(str, shape))}], got input of shape {list(input.shape)}")


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the saved mean / inverse standard deviation (Apex: fp32 for half inputs)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def promote(*dtypes: torch.dtype | None) -> torch.dtype:
    """The promotion of the given dtypes; ``None`` entries (absent parameters) are skipped."""
    out = dtypes[0]
    for d in dtypes[1:]:
        if d is not None:
            out = torch.promote_types(out, d)
    return out


def _select_for_device(device_type: str) -> str:
    return _backend.select_device(device_type)


# The backend override lives in a context variable, which torch.compile cannot trace: the choice is made
# once while tracing and baked into the graph. This is what ``torch.compiler.assume_constant_result``
# does, without importing torch._dynamo (and with it Triton) when apex.normalization is imported.
_select_for_device._dynamo_marked_constant = True  # type: ignore[attr-defined]


def select(input: torch.Tensor) -> str:
    """``apex._backend.select`` for one tensor, usable inside ``torch.compile``-traced code."""
    if not torch.compiler.is_compiling():
        return _backend.select_tensor(input)  # eager: no device object to build
    return _select_for_device(input.device.type)


def use_kernel(input: torch.Tensor, out_dtype: torch.dtype, n: int, *params) -> bool:
    """True when the Triton kernels run this call (backend choice, dtypes and row length they cover)."""
    if select(input) != "triton":
        return False
    if n > MAX_FUSED_N or input.dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES:
        return False
    for p in params:  # a loop, not all(<generator>): asked on every call
        if p is not None and p.dtype not in KERNEL_DTYPES:
            return False
    return True


# How a norm call runs (:func:`route`'s answer).
TORCH = 0  # PyTorch's operators: the torch backend, or a CPU tensor under torch.compile's choice of it
OP = 1  # the registered custom op: compiling, a dispatch mode, torch.func, a tensor subclass, other dtypes
KERNEL = 2  # eager, plain tensors, nothing to differentiate: the Triton launchers called directly
DIRECT = 3  # eager, plain tensors, a gradient needed: the op's plain autograd.Function launching the kernels
EXPORT = 4  # torch.export is tracing: the standard operators exporters know


def _exporting() -> bool:
    """Whether torch.export is tracing, also while Dynamo traces: read as the flag torch.export sets, since
    Dynamo before torch 2.13 folds ``torch.compiler.is_exporting()`` to True under ``torch.compile`` too (which
    would route every compiled norm to PyTorch's operators instead of the registered op)."""
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return torch.compiler.is_exporting() if flag is None else flag


def route(input: torch.Tensor, out_dtype: torch.dtype, n: int, w: torch.Tensor | None = None,
          b: torch.Tensor | None = None, r: torch.Tensor | None = None) -> int:
    """How a call of a norm on checked arguments runs (one of the constants above), decided once per call:
    the backend, the kernels' dtypes and row length, the tracing state and whether a gradient is needed.
    ``w``, ``b``, ``r``: the other tensor arguments (weight, bias, residual) or None."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        if _exporting():
            return EXPORT
        return TORCH if _select_for_device(input.device.type) == "torch" else OP
    if _backend.select_tensor(input) != "triton":
        return TORCH
    # Each test a plain comparison (no loop over a tuple, no generator): asked on every call.
    if (n > MAX_FUSED_N or input.dtype not in KERNEL_DTYPES or out_dtype not in KERNEL_DTYPES
            or w is not None and w.dtype not in KERNEL_DTYPES or b is not None and b.dtype not in KERNEL_DTYPES
            or r is not None and r.dtype not in KERNEL_DTYPES):
        return OP
    if _dispatch_modes() or _are_functorch_transforms_active() or _get_tracing_state() is not None:
        return OP
    if (type(input) not in _PLAIN or type(w) not in _PLAIN_OR_NONE or type(b) not in _PLAIN_OR_NONE
            or type(r) not in _PLAIN_OR_NONE):
        return OP  # a tensor subclass (its __torch_dispatch__ sees the registered op)
    if torch.is_grad_enabled() and _any_requires_grad(input, w, b, r):
        return DIRECT
    return KERNEL


_KERNEL_DTYPE_SET = member_set(*KERNEL_DTYPES)


def prepare(input: object, normalized_shape: object, weight: object, bias: object, out_dtype: torch.dtype | None
            ) -> tuple[tuple[int, ...], int, torch.dtype, int]:
    """:func:`check_args` then :func:`route`: ``(normalized_shape, row_length, out_dtype, route)``, with
    ``out_dtype`` defaulting to the input's. The usual eager call (plain tensors of the kernels' dtypes, one
    normalised dimension, parameters of that shape on the input's device) is checked and routed reading each
    tensor attribute once; anything else, or anything wrong, takes the two functions in turn (their errors)."""
    # is_compiling() alone: torch.export sets the compiling flag with the exporting one (Dynamo answers True for
    # both), so a call that is not compiling is not exporting either.
    if type(input) in _PLAIN and not torch.compiler.is_compiling():
        kind = type(normalized_shape)
        if kind is int:
            n = normalized_shape
        elif (kind is torch.Size or kind is tuple or kind is list) and len(normalized_shape) == 1:
            n = normalized_shape[0]
        else:
            n = None
        dt = input.dtype
        ishape = input.shape
        if type(n) is int and dt in _KERNEL_DTYPE_SET and ishape and ishape[-1] == n:
            shape = (n,)
            on_gpu = input.is_cuda
            ok = True
            for p in (weight, bias):  # the same tests as _check_param's, on the usual types only
                # (shape (n,) as dim and numel: p.shape builds a torch.Size, ~2x their cost)
                if p is not None and (type(p) not in _PLAIN or p.dtype not in _KERNEL_DTYPE_SET or p.dim() != 1
                                      or p.numel() != n or p.is_cuda != on_gpu
                                      or (p.get_device() != input.get_device() if on_gpu
                                          else not (p.is_cpu and input.is_cpu))):
                    ok = False
            if ok:
                out_dtype = out_dtype or dt
                if _backend._resolve(on_gpu, input) != "triton":
                    return shape, n, out_dtype, TORCH
                if (n <= MAX_FUSED_N and out_dtype in _KERNEL_DTYPE_SET
                        and not (_dispatch_modes() or _are_functorch_transforms_active()
                                 or _get_tracing_state() is not None)):
                    if torch.is_grad_enabled() and _any_requires_grad(input, weight, bias):
                        return shape, n, out_dtype, DIRECT
                    return shape, n, out_dtype, KERNEL
                return shape, n, out_dtype, OP
    shape, _, n = check_args(input, normalized_shape, weight, bias)
    out_dtype = out_dtype or input.dtype
    return shape, n, out_dtype, route(input, out_dtype, n, weight, bias)


# apex._kernels._norm in a list once imported (at the first eager call, as lazy_module's: no Triton import
# when apex is). The eager paths (prepare's KERNEL and DIRECT, the _Direct backwards on the kernels) read it
# as ``(LAUNCHERS or launchers())[0]``: lazy_module's getter asks is_compiling() first (two frames a call),
# which only traced code needs, and these paths are never traced.
LAUNCHERS: list = []


def launchers() -> list:
    """:data:`LAUNCHERS`, filled with ``apex._kernels._norm`` at the first call."""
    if not LAUNCHERS:
        import apex._kernels._norm as kernels

        LAUNCHERS.append(kernels)
    return LAUNCHERS


def kernel_backward(dy: torch.Tensor, dr: torch.Tensor | None = None) -> bool:
    """True when an eager ``_Direct`` backward may launch the kernels on the gradients ``dy`` (and ``dr``, or
    None) itself: ``apex.ops._dispatch.eager``'s tests on these tensors, inlined (~1.5 µs less a backward), plus
    no graph being built (a second derivative takes the registered op: its error) and the kernels' dtypes."""
    return not (torch.is_grad_enabled() or dy.dtype not in _KERNEL_DTYPE_SET or type(dy) not in _PLAIN
                or dr is not None and (dr.dtype not in _KERNEL_DTYPE_SET or type(dr) not in _PLAIN)
                or torch.compiler.is_compiling() or _dispatch_modes()  # (exporting is compiling: see prepare)
                or _are_functorch_transforms_active() or _get_tracing_state() is not None)


def grad_rows(g: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """A gradient as the backward kernel reads it, ``(rows, row stride)``: itself when contiguous (autograd's
    usual gradient, whatever its shape; no view, no stride query), else :func:`rows_view`'s."""
    if g.is_contiguous():
        return g, n
    g = rows_view(g, n)
    return g, g.stride(0)


def forward_saving_rows(input: torch.Tensor, n: int, w: torch.Tensor | None, b: torch.Tensor | None, eps: float,
                        out_dtype: torch.dtype, rms: bool) -> tuple:
    """The ``_Direct`` forwards' launch: ``(y, mean, rstd, sv)``, ``sv`` the input's row stride when it is its
    own rows (the backward then needs no :func:`rows_view`, see :func:`saved_rows`), else 0. A contiguous input
    of any shape is its own rows of stride ``n``: no view, no stride query."""
    kernels = (LAUNCHERS or launchers())[0]
    if n and input.is_contiguous():
        y, mean, rstd, _ = kernels.forward_rows(input, n, input.numel() // n, n, w, b, eps, out_dtype, rms, None, 0,
                                                None, input)
        return y, mean, rstd, n
    x = rows_view(input, n)
    y, mean, rstd, _ = kernels.forward(x, w, b, eps, out_dtype, rms, None, None, input)
    return y, mean, rstd, (x.stride(0) if x is input else 0)


def saved_rows(v: torch.Tensor, n: int, memory_efficient: bool, stride: int) -> tuple[torch.Tensor, int]:
    """The tensor a ``_Direct`` forward saved for its backward as the kernel reads it, ``(rows, row stride)``:
    the output (``memory_efficient``), contiguous from the forward, its own rows; else the input, its own rows
    of row stride ``stride`` when the forward found it so (``stride`` > 0), else :func:`rows_view`'s. Each only
    where ``v`` still has that layout: a saved-tensor hook may give it back in another (``save_on_cpu`` makes a
    strided tensor dense), and then its rows are :func:`rows_view`'s of what it is now."""
    if memory_efficient or stride == n:  # (the output, or an input that was contiguous)
        if v.is_contiguous():
            return v, n
    elif stride and v.dim() == 2 and v.stride() == (stride, 1):
        return v, stride
    v = rows_view(v, n)
    return v, v.stride(0)


def _f32(stat: torch.Tensor) -> torch.Tensor:
    """``stat.float()`` without the call (~0.3 µs) for the Triton forward's statistics, fp32 already."""
    return stat if stat.dtype is torch.float32 else stat.float()


def rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as a 2-D ``(rows, n)`` tensor with unit column stride, a view whenever strides allow."""
    if t.dim() == 2 and t.stride(1) == 1:  # already one (a call's usual input): no view to make
        return t
    t2 = t.reshape(-1, n) if n > 0 else t.reshape(-1, 0)
    if t2.stride(-1) != 1 and n > 1:
        t2 = t2.contiguous()
    return t2


def autocast_args(device_type: str, *args):
    """Apex's ``_cast_if_autocast_enabled``: cast floating tensors to the autocast dtype of the device.

    The normalisation then runs with autocast off, so its output dtype follows the (cast) arguments.
    """
    if not torch.is_autocast_enabled(device_type):
        return args
    dt = torch.get_autocast_dtype(device_type)
    # As torch.amp's own casting: float64 tensors and tensors on other devices are left alone.
    return tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != torch.float64
                 and a.device.type == device_type else a for a in args)
