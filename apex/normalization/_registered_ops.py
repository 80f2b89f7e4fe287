"""Apex's eight ``torch.library`` ops of ``apex.normalization.fused_layer_norm`` (``apex::fused_layer_norm_fwd``,
``apex::fused_rms_norm_affine_bwd``, ...): the same names, schemas, fake implementations and autograd.

Client code calls them as ``fused_layer_norm.fused_rms_norm_affine_fwd(...)`` or
``torch.ops.apex.fused_rms_norm_affine_fwd(...)``, and ``torch.compile`` / ``torch.export`` graphs name them.
Each kernel calls the ``fused_layer_norm_cuda`` compatibility module's function of the same contract, so it runs
on the Triton kernels for CUDA/ROCm tensors and on PyTorch's operators for CPU tensors.

The ops are registered with one ``torch.library.Library`` fragment from fixed schema strings and a fixed
``autograd.Function``: about a millisecond for all eight at import, where ``torch.library.custom_op`` (Apex's
way) infers each schema and builds an autograd class per op at several milliseconds each. The schemas are the
ones ``custom_op`` infers from Apex's signatures, so graphs and ``torch.ops.apex`` calls see the same ops.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import _C

from apex._errors import RuntimeValueError

Tensor = torch.Tensor
_MODULE = "apex.normalization.fused_layer_norm"


def _ext():
    """The ``fused_layer_norm_cuda`` module, also stored as ``fused_layer_norm.fused_layer_norm_cuda`` (Apex's
    global: None until a module first imports the extension)."""
    owner = sys.modules[_MODULE]
    ext = owner.fused_layer_norm_cuda
    if ext is None:
        ext = owner.fused_layer_norm_cuda = importlib.import_module("fused_layer_norm_cuda")
    return ext


def _stats(input: Tensor, normalized_shape: list[int]) -> Tensor:
    """An empty per-row statistic as the extension returns it: one entry per row, fp32 for half inputs."""
    rows = 1
    for s in input.shape[:input.dim() - len(normalized_shape)]:
        rows *= s
    dtype = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    return torch.empty([rows], dtype=dtype, device=input.device)


def _check_bwd(grad_output: Tensor, mean: Tensor | None, input_or_output: Tensor, memory_efficient: bool) -> None:
    # Apex's extension rejects these with TORCH_CHECK (a RuntimeError); the class here is also a ValueError.
    if grad_output.shape != input_or_output.shape:
        raise RuntimeValueError(f"grad_output has shape {list(grad_output.shape)}, expected input_or_output's "
                                f"{list(input_or_output.shape)}")
    if mean is None and not memory_efficient:
        raise RuntimeValueError("mean is required unless memory_efficient=True")


# ---------------------------------------------------------------------------------------- op kernels
def _fused_layer_norm_affine_fwd_kernel(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: list[int],
                                eps: float, memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``apex::fused_layer_norm_affine_fwd``: ``(output, mean, invvar)`` of LayerNorm with weight and bias over
    the trailing ``normalized_shape`` dims; output in the input dtype, ``mean``/``invvar`` one per row (fp32
    for fp16/bf16 inputs). ``memory_efficient`` picks what its autograd saves (the output, not the input).
    Bad shapes raise a ``RuntimeError`` (also a ``ValueError``) naming the argument."""
    output, mean, invvar = _ext().forward_affine(input.contiguous(), normalized_shape, weight.contiguous(),
                                                        bias.contiguous(), eps)
    return output, mean, invvar


def fused_layer_norm_affine_fwd_fake(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: list[int],
                                     eps: float, memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fake (meta) implementation of :func:`fused_layer_norm_affine_fwd`: empty tensors of its outputs'
    shapes and dtypes."""
    mean = _stats(input, normalized_shape)
    return torch.empty_like(input, memory_format=torch.contiguous_format), mean, torch.empty_like(mean)


def _fused_layer_norm_affine_bwd_kernel(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                                normalized_shape: list[int], weight: Tensor, bias: Tensor, eps: float,
                                memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``apex::fused_layer_norm_affine_bwd``: ``(grad_input, grad_weight, grad_bias)`` from the forward's
    statistics and its input, or with ``memory_efficient=True`` its output (``mean`` is then unused and may be
    None)."""
    _check_bwd(grad_output, mean, input_or_output, memory_efficient)
    grad_input, grad_weight, grad_bias = _ext().backward_affine(
        grad_output.contiguous(), mean, invvar, input_or_output.contiguous(), normalized_shape, weight, bias, eps,
        memory_efficient)
    return grad_input, grad_weight, grad_bias


def fused_layer_norm_affine_bwd_fake(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                                     normalized_shape: list[int], weight: Tensor, bias: Tensor, eps: float,
                                     memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fake implementation of :func:`fused_layer_norm_affine_bwd`."""
    return (torch.empty_like(input_or_output, memory_format=torch.contiguous_format), torch.empty_like(weight),
            torch.empty_like(bias))


def _fused_layer_norm_fwd_kernel(input: Tensor, normalized_shape: list[int], eps: float, memory_efficient: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor]:
    """``apex::fused_layer_norm_fwd``: :func:`fused_layer_norm_affine_fwd` without weight and bias."""
    output, mean, invvar = _ext().forward(input.contiguous(), normalized_shape, eps)
    return output, mean, invvar


def fused_layer_norm_fwd_fake(input: Tensor, normalized_shape: list[int], eps: float,
                              memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The fake implementation of :func:`fused_layer_norm_fwd`."""
    mean = _stats(input, normalized_shape)
    return torch.empty_like(input, memory_format=torch.contiguous_format), mean, torch.empty_like(mean)


def _fused_layer_norm_bwd_kernel(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                         normalized_shape: list[int], eps: float, memory_efficient: bool = False) -> Tensor:
    """``apex::fused_layer_norm_bwd``: ``grad_input`` of :func:`fused_layer_norm_fwd`."""
    _check_bwd(grad_output, mean, input_or_output, memory_efficient)
    return _ext().backward(grad_output.contiguous(), mean, invvar, input_or_output.contiguous(), normalized_shape,
                          eps, memory_efficient)


def fused_layer_norm_bwd_fake(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                              normalized_shape: list[int], eps: float, memory_efficient: bool = False) -> Tensor:
    """The fake implementation of :func:`fused_layer_norm_bwd`."""
    return torch.empty_like(input_or_output, memory_format=torch.contiguous_format)


def _fused_rms_norm_affine_fwd_kernel(input: Tensor, weight: Tensor, normalized_shape: list[int], eps: float,
                              memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """``apex::fused_rms_norm_affine_fwd``: ``(output, invvar)`` of RMSNorm with weight, ``x / sqrt(mean(x²) +
    eps) * weight``; output in the input dtype, ``invvar`` one per row (fp32 for fp16/bf16 inputs)."""
    output, invvar = _ext().rms_forward_affine(input.contiguous(), normalized_shape, weight.contiguous(), eps)
    return output, invvar


def fused_rms_norm_affine_fwd_fake(input: Tensor, weight: Tensor, normalized_shape: list[int], eps: float,
                                   memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """The fake implementation of :func:`fused_rms_norm_affine_fwd`."""
    return torch.empty_like(input, memory_format=torch.contiguous_format), _stats(input, normalized_shape)


def _fused_rms_norm_affine_bwd_kernel(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor,
                              normalized_shape: list[int], weight: Tensor, eps: float,
                              memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """``apex::fused_rms_norm_affine_bwd``: ``(grad_input, grad_weight)`` from ``invvar`` and the forward's
    input (or, with ``memory_efficient=True``, its output)."""
    _check_bwd(grad_output, invvar, input_or_output, memory_efficient)
    grad_input, grad_weight = _ext().rms_backward_affine(grad_output.contiguous(), invvar, input_or_output.contiguous(),
                                                         normalized_shape, weight, eps, memory_efficient)
    return grad_input, grad_weight


def fused_rms_norm_affine_bwd_fake(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor,
                                   normalized_shape: list[int], weight: Tensor, eps: float,
                                   memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    """The fake implementation of :func:`fused_rms_norm_affine_bwd`."""
    return torch.empty_like(input_or_output, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _fused_rms_norm_fwd_kernel(input: Tensor, normalized_shape: list[int], eps: float, memory_efficient: bool = False
                       ) -> tuple[Tensor, Tensor]:
    """``apex::fused_rms_norm_fwd``: :func:`fused_rms_norm_affine_fwd` without weight."""
    output, invvar = _ext().rms_forward(input.contiguous(), normalized_shape, eps)
    return output, invvar


def fused_rms_norm_fwd_fake(input: Tensor, normalized_shape: list[int], eps: float, memory_efficient: bool = False
                            ) -> tuple[Tensor, Tensor]:
    """The fake implementation of :func:`fused_rms_norm_fwd`."""
    return torch.empty_like(input, memory_format=torch.contiguous_format), _stats(input, normalized_shape)


def _fused_rms_norm_bwd_kernel(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor,
                               normalized_shape: list[int], eps: float, memory_efficient: bool = False) -> Tensor:
    """``apex::fused_rms_norm_bwd``: ``grad_input`` of :func:`fused_rms_norm_fwd`."""
    _check_bwd(grad_output, invvar, input_or_output, memory_efficient)
    return _ext().rms_backward(grad_output.contiguous(), invvar, input_or_output.contiguous(), normalized_shape, eps,
                               memory_efficient)


def fused_rms_norm_bwd_fake(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor,
                            normalized_shape: list[int], eps: float, memory_efficient: bool = False) -> Tensor:
    """The fake implementation of :func:`fused_rms_norm_bwd`."""
    return torch.empty_like(input_or_output, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------------- autograd
# As Apex's: the forward saves its input (or, memory_efficient, its output, then no mean) and the statistics,
# and the backward calls the matching _bwd op, so a graph's backward names that op too.
def _layer_norm_affine_setup(ctx, inputs, output):
    input, weight, bias, normalized_shape, eps, memory_efficient = inputs
    y, mean, invvar = output
    if memory_efficient:
        ctx.save_for_backward(y, weight.contiguous(), bias.contiguous(), None, invvar)
    else:
        ctx.save_for_backward(input.contiguous(), weight.contiguous(), bias.contiguous(), mean, invvar)
    ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient


def _layer_norm_affine_backward(ctx, grad_output, grad_mean, grad_invvar):
    v, weight, bias, mean, invvar = ctx.saved_tensors
    grads = torch.ops.apex.fused_layer_norm_affine_bwd(grad_output, mean, invvar, v, ctx.normalized_shape, weight,
                                                       bias, ctx.eps, ctx.memory_efficient)
    return (*grads, None, None, None)


def _layer_norm_setup(ctx, inputs, output):
    input, normalized_shape, eps, memory_efficient = inputs
    y, mean, invvar = output
    if memory_efficient:
        ctx.save_for_backward(y, None, invvar)
    else:
        ctx.save_for_backward(input.contiguous(), mean, invvar)
    ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient


def _layer_norm_backward(ctx, grad_output, grad_mean, grad_invvar):
    v, mean, invvar = ctx.saved_tensors
    grad_input = torch.ops.apex.fused_layer_norm_bwd(grad_output, mean, invvar, v, ctx.normalized_shape, ctx.eps,
                                                     ctx.memory_efficient)
    return grad_input, None, None, None


def _rms_norm_affine_setup(ctx, inputs, output):
    input, weight, normalized_shape, eps, memory_efficient = inputs
    y, invvar = output
    ctx.save_for_backward(y if memory_efficient else input.contiguous(), weight.contiguous(), invvar)
    ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient


def _rms_norm_affine_backward(ctx, grad_output, grad_invvar):
    v, weight, invvar = ctx.saved_tensors
    grads = torch.ops.apex.fused_rms_norm_affine_bwd(grad_output, invvar, v, ctx.normalized_shape, weight, ctx.eps,
                                                     ctx.memory_efficient)
    return (*grads, None, None, None)


def _rms_norm_setup(ctx, inputs, output):
    input, normalized_shape, eps, memory_efficient = inputs
    y, invvar = output
    ctx.save_for_backward(y if memory_efficient else input.contiguous(), invvar)
    ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient


def _rms_norm_backward(ctx, grad_output, grad_invvar):
    v, invvar = ctx.saved_tensors
    grad_input = torch.ops.apex.fused_rms_norm_bwd(grad_output, invvar, v, ctx.normalized_shape, ctx.eps,
                                                   ctx.memory_efficient)
    return grad_input, None, None, None


class _Spec(NamedTuple):
    name: str
    nparams: int
    setup: Callable | None
    backward: Callable | None


class _OpAutograd(torch.autograd.Function):
    """The ops' ``Autograd`` kernel, as ``torch.library.custom_op``'s generated one: the op below autograd,
    then the op's ``setup``; the statistics outputs are not differentiable (the backward ignores them). A
    ``_bwd`` op has no derivative: its backward raises, as Apex's ops without ``register_autograd`` do."""

    @staticmethod
    def forward(ctx, spec, keyset, *args):
        op = getattr(torch.ops.apex, spec.name).default
        with _C._AutoDispatchBelowAutograd():
            out = op.redispatch(keyset & _C._after_autograd_keyset, *args)
        ctx.spec = spec
        if spec.setup is not None:
            # The dispatcher leaves out arguments equal to their defaults: memory_efficient, the one default.
            spec.setup(ctx, args if len(args) == spec.nparams else (*args, False), out)
            ctx.mark_non_differentiable(*out[1:])
        return out

    @staticmethod
    def backward(ctx, *grads):
        spec = ctx.spec
        if spec.backward is None:
            raise RuntimeError(f"Trying to backward through apex::{spec.name} but no autograd formula was "
                               "registered (it is itself a backward)")
        return (None, None, *spec.backward(ctx, *grads))


def _autograd_kernel(spec: _Spec) -> Callable:
    def kernel(keyset, *args):
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            return _OpAutograd.apply(spec, keyset, *args)
        with _C._AutoDispatchBelowAutograd():
            return getattr(torch.ops.apex, spec.name).default.redispatch(keyset & _C._after_autograd_keyset, *args)
    return kernel


_TENSORS3 = "(Tensor, Tensor, Tensor)"
# name -> (schema after the name, kernel, fake, setup, backward); the schemas are custom_op's for Apex's signatures.
_OPS: dict[str, tuple] = {
    "fused_layer_norm_affine_fwd": (
        "(Tensor input, Tensor weight, Tensor bias, SymInt[] normalized_shape, float eps, "
        f"bool memory_efficient=False) -> {_TENSORS3}",
        _fused_layer_norm_affine_fwd_kernel, fused_layer_norm_affine_fwd_fake, _layer_norm_affine_setup,
        _layer_norm_affine_backward),
    "fused_layer_norm_affine_bwd": (
        "(Tensor grad_output, Tensor mean, Tensor invvar, Tensor input_or_output, SymInt[] normalized_shape, "
        f"Tensor weight, Tensor bias, float eps, bool memory_efficient=False) -> {_TENSORS3}",
        _fused_layer_norm_affine_bwd_kernel, fused_layer_norm_affine_bwd_fake, None, None),
    "fused_layer_norm_fwd": (
        f"(Tensor input, SymInt[] normalized_shape, float eps, bool memory_efficient=False) -> {_TENSORS3}",
        _fused_layer_norm_fwd_kernel, fused_layer_norm_fwd_fake, _layer_norm_setup, _layer_norm_backward),
    "fused_layer_norm_bwd": (
        "(Tensor grad_output, Tensor mean, Tensor invvar, Tensor input_or_output, SymInt[] normalized_shape, "
        "float eps, bool memory_efficient=False) -> Tensor",
        _fused_layer_norm_bwd_kernel, fused_layer_norm_bwd_fake, None, None),
    "fused_rms_norm_affine_fwd": (
        "(Tensor input, Tensor weight, SymInt[] normalized_shape, float eps, bool memory_efficient=False) "
        "-> (Tensor, Tensor)",
        _fused_rms_norm_affine_fwd_kernel, fused_rms_norm_affine_fwd_fake, _rms_norm_affine_setup,
        _rms_norm_affine_backward),
    "fused_rms_norm_affine_bwd": (
        "(Tensor grad_output, Tensor invvar, Tensor input_or_output, SymInt[] normalized_shape, Tensor weight, "
        "float eps, bool memory_efficient=False) -> (Tensor, Tensor)",
        _fused_rms_norm_affine_bwd_kernel, fused_rms_norm_affine_bwd_fake, None, None),
    "fused_rms_norm_fwd": (
        "(Tensor input, SymInt[] normalized_shape, float eps, bool memory_efficient=False) -> (Tensor, Tensor)",
        _fused_rms_norm_fwd_kernel, fused_rms_norm_fwd_fake, _rms_norm_setup, _rms_norm_backward),
    "fused_rms_norm_bwd": (
        "(Tensor grad_output, Tensor invvar, Tensor input_or_output, SymInt[] normalized_shape, float eps, "
        "bool memory_efficient=False) -> Tensor",
        _fused_rms_norm_bwd_kernel, fused_rms_norm_bwd_fake, None, None),
}


def _register_fake(lib: torch.library.Library, name: str, fake: Callable) -> None:
    """``lib._register_fake(name, fake)`` without its two stack inspections (``inspect.getmodule`` scans
    ``sys.modules``: 2 ms an op, most of this module's import), where PyTorch's registry allows it."""
    try:
        entry = torch._library.simple_registry.singleton.find(f"apex::{name}")
        lib._registration_handles.append(entry.fake_impl.register(fake, __file__, lib=lib))
    except AttributeError:  # another PyTorch layout: the public route
        lib._register_fake(name, fake)


def _register() -> torch.library.Library | None:
    if _C._dispatch_has_kernel("apex::fused_layer_norm_affine_fwd"):  # registered already (a module reload)
        return None
    lib = torch.library.Library("apex", "FRAGMENT")
    for name, (schema, kernel, fake, setup, backward) in _OPS.items():
        lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        lib.impl(name, kernel, "CompositeExplicitAutograd")
        _register_fake(lib, name, fake)
        spec = _Spec(name, kernel.__code__.co_argcount, setup, backward)
        lib.impl(name, _autograd_kernel(spec), "Autograd", with_keyset=True)
    return lib


_LIB = _register()


# ------------------------------------------------------------------------------ Apex's module-level names
# Calls through the dispatcher (torch.ops.apex.<name>): autograd, fake tensors and graphs see the op.
def fused_layer_norm_affine_fwd(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape: list[int],
                                eps: float, memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.apex.fused_layer_norm_affine_fwd(input, weight, bias, normalized_shape, eps, memory_efficient)


def fused_layer_norm_affine_bwd(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                                normalized_shape: list[int], weight: Tensor, bias: Tensor, eps: float,
                                memory_efficient: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.apex.fused_layer_norm_affine_bwd(grad_output, mean, invvar, input_or_output, normalized_shape,
                                                      weight, bias, eps, memory_efficient)


def fused_layer_norm_fwd(input: Tensor, normalized_shape: list[int], eps: float, memory_efficient: bool = False
                         ) -> tuple[Tensor, Tensor, Tensor]:
    return torch.ops.apex.fused_layer_norm_fwd(input, normalized_shape, eps, memory_efficient)


def fused_layer_norm_bwd(grad_output: Tensor, mean: Tensor, invvar: Tensor, input_or_output: Tensor,
                         normalized_shape: list[int], eps: float, memory_efficient: bool = False) -> Tensor:
    return torch.ops.apex.fused_layer_norm_bwd(grad_output, mean, invvar, input_or_output, normalized_shape, eps,
                                               memory_efficient)


def fused_rms_norm_affine_fwd(input: Tensor, weight: Tensor, normalized_shape: list[int], eps: float,
                              memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    return torch.ops.apex.fused_rms_norm_affine_fwd(input, weight, normalized_shape, eps, memory_efficient)


def fused_rms_norm_affine_bwd(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor,
                              normalized_shape: list[int], weight: Tensor, eps: float,
                              memory_efficient: bool = False) -> tuple[Tensor, Tensor]:
    return torch.ops.apex.fused_rms_norm_affine_bwd(grad_output, invvar, input_or_output, normalized_shape, weight,
                                                    eps, memory_efficient)


def fused_rms_norm_fwd(input: Tensor, normalized_shape: list[int], eps: float, memory_efficient: bool = False
                       ) -> tuple[Tensor, Tensor]:
    return torch.ops.apex.fused_rms_norm_fwd(input, normalized_shape, eps, memory_efficient)


def fused_rms_norm_bwd(grad_output: Tensor, invvar: Tensor, input_or_output: Tensor, normalized_shape: list[int],
                       eps: float, memory_efficient: bool = False) -> Tensor:
    return torch.ops.apex.fused_rms_norm_bwd(grad_output, invvar, input_or_output, normalized_shape, eps,
                                             memory_efficient)


PUBLIC = tuple(name for op in _OPS for name in (op, op + "_fake"))
for _name, (_, _kernel, _fake, _, _) in _OPS.items():
    # Documented where Apex defines them; each op's docstring is its kernel's.
    globals()[_name].__doc__ = _kernel.__doc__
    for _f in (globals()[_name], _fake):
        _f.__module__ = _MODULE
del _name, _kernel, _fake, _f
