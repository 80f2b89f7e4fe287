"""Apex's ``apex.normalization.fused_layer_norm``: modules, functional forms and autograd Functions.

Every entry runs on any device: the Triton kernels on CUDA/ROCm tensors, PyTorch's operators on CPU
tensors (see ``apex.ops.layer_norm`` and ``apex.ops.rms_norm`` for the math and the dtype policy).

Output dtypes: ``FusedLayerNorm``/``FusedRMSNorm`` and the plain functional forms return the input dtype;
the ``Mixed*`` modules and ``mixed_dtype_*`` functions return the parameter dtype (Megatron-style fp32
weights with fp16/bf16 activations give fp32 outputs). Under autocast the functional forms first cast
their floating-point arguments to the autocast dtype and then run with autocast off, as Apex does.
"""

from __future__ import annotations

import numbers
import warnings

import torch
import torch.nn.functional as F
from torch._C import _get_tracing_state
from torch.nn import init
from torch.nn.parameter import Parameter

import apex.normalization._registered_ops as _registered
from apex.ops._norm import as_shape, autocast_args
from apex.ops.layer_norm import _lean as _ln_lean
from apex.ops.layer_norm import layer_norm, layer_norm_backward, layer_norm_forward, layer_norm_general
from apex.ops.rms_norm import _lean as _rms_lean
from apex.ops.rms_norm import rms_norm, rms_norm_backward, rms_norm_forward, rms_norm_general

Tensor = torch.Tensor

# Apex's global: the ``fused_layer_norm_cuda`` module once a module or op has imported it, None before.
fused_layer_norm_cuda = None


def supports_custom_op() -> bool:
    """Whether this PyTorch has ``torch.library.custom_op`` (2.4 and later), which Apex's registered ops need."""
    return hasattr(torch.library, "custom_op")


# Apex's eight registered ops (apex::fused_layer_norm_affine_fwd, ...) and their fake implementations.
fused_layer_norm_affine_bwd = _registered.fused_layer_norm_affine_bwd
fused_layer_norm_affine_bwd_fake = _registered.fused_layer_norm_affine_bwd_fake
fused_layer_norm_affine_fwd = _registered.fused_layer_norm_affine_fwd
fused_layer_norm_affine_fwd_fake = _registered.fused_layer_norm_affine_fwd_fake
fused_layer_norm_bwd = _registered.fused_layer_norm_bwd
fused_layer_norm_bwd_fake = _registered.fused_layer_norm_bwd_fake
fused_layer_norm_fwd = _registered.fused_layer_norm_fwd
fused_layer_norm_fwd_fake = _registered.fused_layer_norm_fwd_fake
fused_rms_norm_affine_bwd = _registered.fused_rms_norm_affine_bwd
fused_rms_norm_affine_bwd_fake = _registered.fused_rms_norm_affine_bwd_fake
fused_rms_norm_affine_fwd = _registered.fused_rms_norm_affine_fwd
fused_rms_norm_affine_fwd_fake = _registered.fused_rms_norm_affine_fwd_fake
fused_rms_norm_bwd = _registered.fused_rms_norm_bwd
fused_rms_norm_bwd_fake = _registered.fused_rms_norm_bwd_fake
fused_rms_norm_fwd = _registered.fused_rms_norm_fwd
fused_rms_norm_fwd_fake = _registered.fused_rms_norm_fwd_fake


def _autocast_call(fn, input, *args):
    """Run ``fn(input, *args)`` the way Apex's functional forms do under autocast."""
    # One query for every device type first: with autocast off (the usual call) no device object is built.
    if torch._C._is_any_autocast_enabled():
        device_type = input.device.type if isinstance(input, torch.Tensor) else "cpu"
        if device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type):
            cast = autocast_args(device_type, input, *args)
            with torch.autocast(device_type=device_type, enabled=False):
                return fn(*cast)
    return fn(input, *args)


# The functional forms' argument orders with the tensors first, for _autocast_call (no lambda per call).
def _layer_norm_affine(x, w, b, normalized_shape, eps, memory_efficient):
    return layer_norm(x, normalized_shape, w, b, eps, memory_efficient)


def _rms_norm_affine(x, w, normalized_shape, eps, memory_efficient):
    return rms_norm(x, normalized_shape, w, eps, memory_efficient)


# Reference implementation from Hugging Face, kept with Apex's name and behaviour.
def manual_rms_norm(input: Tensor, normalized_shape, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm in plain PyTorch: statistics in fp32; with a half-precision weight the normalised input is
    cast to the weight dtype before the scale, otherwise the result keeps the promoted dtype."""
    shape = as_shape(normalized_shape)
    dims = tuple(range(-1, -len(shape) - 1, -1))
    variance = input.to(torch.float32).pow(2).mean(dims, keepdim=True)
    input = input * torch.rsqrt(variance + eps)
    if weight is None:
        return input
    if weight.dtype in (torch.float16, torch.bfloat16):
        input = input.to(weight.dtype)
    return weight * input


# ------------------------------------------------------------------------------------ functional forms
def fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape, eps: float = 1e-6,
                            memory_efficient: bool = False) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the trailing ``normalized_shape`` dims.

    Statistics in fp32; the output has the input's dtype (under autocast: the autocast dtype).
    ``memory_efficient=True`` saves the output instead of the input for backward.
    """
    return _autocast_call(_layer_norm_affine, input, weight, bias, normalized_shape, eps, memory_efficient)


def fused_layer_norm(input: Tensor, normalized_shape, eps: float = 1e-6, memory_efficient: bool = False
                     ) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the trailing ``normalized_shape`` dims, without weight or bias."""
    return _autocast_call(layer_norm, input, normalized_shape, None, None, eps, memory_efficient)


def mixed_dtype_fused_layer_norm_affine(input: Tensor, weight: Tensor, bias: Tensor, normalized_shape,
                                        eps: float = 1e-6, memory_efficient: bool = False) -> Tensor:
    """As :func:`fused_layer_norm_affine`, but the output has the weight's dtype (fp32 weights with
    half activations give fp32 outputs, Megatron's ``MixedFusedLayerNorm``).
    """
    return _autocast_call(
        lambda x, w, b: layer_norm(x, normalized_shape, w, b, eps, memory_efficient, out_dtype=w.dtype),
        input, weight, bias)


def fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape, eps: float = 1e-6,
                          memory_efficient: bool = False) -> Tensor:
    """``x / sqrt(mean(x²) + eps) * weight`` over the trailing ``normalized_shape`` dims; fp32 statistics,
    output in the input dtype.
    """
    return _autocast_call(_rms_norm_affine, input, weight, normalized_shape, eps, memory_efficient)


def fused_rms_norm(input: Tensor, normalized_shape, eps: float = 1e-6, memory_efficient: bool = False
                   ) -> Tensor:
    """``x / sqrt(mean(x²) + eps)`` over the trailing ``normalized_shape`` dims, without weight."""
    return _autocast_call(rms_norm, input, normalized_shape, None, eps, memory_efficient)


def mixed_dtype_fused_rms_norm_affine(input: Tensor, weight: Tensor, normalized_shape, eps: float = 1e-6,
                                      memory_efficient: bool = False) -> Tensor:
    """As :func:`fused_rms_norm_affine`, with the output in the weight's dtype."""
    return _autocast_call(
        lambda x, w: rms_norm(x, normalized_shape, w, eps, memory_efficient, out_dtype=w.dtype),
        input, weight)


# ------------------------------------------------------------------------------- autograd Functions
class FusedLayerNormAffineFunction(torch.autograd.Function):
    """``apply(input, weight, bias, normalized_shape, eps, memory_efficient=False)``."""

    _mixed = False

    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        mixed = ctx._forward_cls._mixed
        output, mean, invvar = layer_norm_forward(input, normalized_shape, weight, bias, eps,
                                                  weight.dtype if mixed else None)
        ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient
        ctx.input_dtype = input.dtype
        if memory_efficient:
            ctx.save_for_backward(output, weight, bias, None, invvar)
        else:
            ctx.save_for_backward(input, weight, bias, mean, invvar)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        v, weight, bias, mean, invvar = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(grad_output, mean, invvar, v, ctx.normalized_shape, weight, bias,
                                         ctx.memory_efficient, ctx.input_dtype, eps=ctx.eps)
        return dx, dw, db, None, None, None


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    """As :class:`FusedLayerNormAffineFunction`, with the output in the weight dtype."""

    _mixed = True


class FusedLayerNormFunction(torch.autograd.Function):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        output, mean, invvar = layer_norm_forward(input, normalized_shape, None, None, eps)
        ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient
        if memory_efficient:
            ctx.save_for_backward(output, None, invvar)
        else:
            ctx.save_for_backward(input, mean, invvar)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        v, mean, invvar = ctx.saved_tensors
        dx, _, _ = layer_norm_backward(grad_output, mean, invvar, v, ctx.normalized_shape, None, None,
                                       ctx.memory_efficient, eps=ctx.eps)
        return dx, None, None, None


class FusedRMSNormAffineFunction(torch.autograd.Function):
    """``apply(input, weight, normalized_shape, eps, memory_efficient=False)``."""

    _mixed = False

    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        mixed = ctx._forward_cls._mixed
        output, invvar = rms_norm_forward(input, normalized_shape, weight, eps,
                                          weight.dtype if mixed else None)
        ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient
        ctx.input_dtype = input.dtype
        ctx.save_for_backward(output if memory_efficient else input, weight, invvar)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        v, weight, invvar = ctx.saved_tensors
        dx, dw = rms_norm_backward(grad_output, invvar, v, ctx.normalized_shape, weight, ctx.memory_efficient,
                                   ctx.input_dtype, eps=ctx.eps)
        return dx, dw, None, None, None


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    """As :class:`FusedRMSNormAffineFunction`, with the output in the weight dtype."""

    _mixed = True


class FusedRMSNormFunction(torch.autograd.Function):
    """``apply(input, normalized_shape, eps, memory_efficient=False)``."""

    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        output, invvar = rms_norm_forward(input, normalized_shape, None, eps)
        ctx.normalized_shape, ctx.eps, ctx.memory_efficient = normalized_shape, eps, memory_efficient
        ctx.save_for_backward(output if memory_efficient else input, invvar)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        v, invvar = ctx.saved_tensors
        dx, _ = rms_norm_backward(grad_output, invvar, v, ctx.normalized_shape, None, ctx.memory_efficient,
                                  eps=ctx.eps)
        return dx, None, None, None


# ---------------------------------------------------------------------------------------------- modules
class _FusedNorm(torch.nn.Module):
    """Shared construction of the fused norm modules: ``_AFFINE`` names each affine parameter (in
    registration order) and its initialiser."""

    _AFFINE: dict = {}

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 memory_efficient: bool = False):
        super().__init__()
        if isinstance(normalized_shape, numbers.Integral):
            normalized_shape = (normalized_shape,)
        self.normalized_shape = torch.Size(as_shape(normalized_shape))
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        for name in self._AFFINE:
            if self.elementwise_affine:
                setattr(self, name, Parameter(torch.empty(*self.normalized_shape)))
            else:
                self.register_parameter(name, None)
        self.reset_parameters()

    def _param(self, name: str) -> Tensor | None:
        """``getattr(self, name)`` without ``nn.Module.__getattr__`` (~1 µs a parameter, every call) when the
        parameter is registered; anything else (a parametrization's property, a plain attribute put in its
        place by a wrapper) by the ordinary lookup."""
        params = self._parameters
        return params[name] if name in params else getattr(self, name)

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            for name, init_ in self._AFFINE.items():
                init_(getattr(self, name))

    def extra_repr(self) -> str:
        return "{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}".format(**self.__dict__)


class FusedLayerNorm(_FusedNorm):
    r"""Layer normalisation over the trailing ``normalized_shape`` dimensions.

    .. math:: y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \cdot \gamma + \beta

    ``weight`` (γ, ones) and ``bias`` (β, zeros) have shape ``normalized_shape`` when
    ``elementwise_affine``. The output has the input dtype. ``memory_efficient=True`` saves the output
    instead of the input for the backward.
    """

    _AFFINE = {"weight": init.ones_, "bias": init.zeros_}

    def forward(self, input: Tensor) -> Tensor:
        # torch.jit.is_tracing() is is_scripting() then _is_tracing(), two frames more; TorchScript takes the
        # is_scripting() branch alone (a constant there) and Dynamo answers None for _get_tracing_state().
        if torch.jit.is_scripting() or _get_tracing_state() is not None:
            # A traced or scripted graph (TorchScript, ONNX export) records PyTorch's own op, as in Apex.
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        if self.elementwise_affine:
            params = self._parameters
            # _param inlined (a frame fewer on every call): a registered parameter, else the ordinary lookup.
            weight = params["weight"] if "weight" in params else self.weight
            bias = params["bias"] if "bias" in params else self.bias
        else:
            weight = bias = None
        if torch._C._is_any_autocast_enabled():
            return _autocast_call(_layer_norm_affine, input, weight, bias, self.normalized_shape, self.eps,
                                  self.memory_efficient)
        # Autocast off (one query): layer_norm's call without its frame, its lean path first.
        out = _ln_lean(input, self.normalized_shape, weight, bias, self.eps, self.memory_efficient, None)
        if out is not None:
            return out
        return layer_norm_general(input, self.normalized_shape, weight, bias, self.eps, self.memory_efficient, None)


class FusedRMSNorm(_FusedNorm):
    r"""RMS normalisation over the trailing ``normalized_shape`` dimensions.

    .. math:: y = \frac{x}{\sqrt{\mathrm{E}[x^2] + \epsilon}} \cdot \gamma

    ``weight`` (γ, ones) has shape ``normalized_shape`` when ``elementwise_affine``. The output has the
    input dtype. ``memory_efficient=True`` saves the output instead of the input for the backward.
    """

    _AFFINE = {"weight": init.ones_}

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting() or _get_tracing_state() is not None:  # (see FusedLayerNorm.forward)
            return manual_rms_norm(input, self.normalized_shape, self.weight, self.eps)
        if self.elementwise_affine:
            params = self._parameters
            weight = params["weight"] if "weight" in params else self.weight
        else:
            weight = None
        if torch._C._is_any_autocast_enabled():
            return _autocast_call(_rms_norm_affine, input, weight, self.normalized_shape, self.eps,
                                  self.memory_efficient)
        out = _rms_lean(input, self.normalized_shape, weight, None, self.eps, self.memory_efficient, None)
        if out is not None:  # (as FusedLayerNorm.forward)
            return out
        return rms_norm_general(input, self.normalized_shape, weight, self.eps, self.memory_efficient, None)


def _mixed_affine_kwargs(cls_name: str, kwargs: dict) -> None:
    if "elementwise_affine" in kwargs:
        warnings.warn(f"{cls_name} does not support `elementwise_affine` argument", stacklevel=3)
        if not kwargs.pop("elementwise_affine"):
            raise RuntimeError(f"{cls_name} does not support `elementwise_affine = False`")


class MixedFusedLayerNorm(FusedLayerNorm):
    """:class:`FusedLayerNorm` whose output has the parameters' dtype (fp32 weights, half inputs)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs):
        _mixed_affine_kwargs("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting() or _get_tracing_state() is not None:  # (see FusedLayerNorm.forward)
            return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)
        return mixed_dtype_fused_layer_norm_affine(input, self._param("weight"), self._param("bias"),
                                                   self.normalized_shape, self.eps, self.memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """:class:`FusedRMSNorm` whose output has the parameter's dtype (fp32 weight, half inputs)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, *, memory_efficient: bool = False, **kwargs):
        _mixed_affine_kwargs("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         memory_efficient=memory_efficient)

    def forward(self, input: Tensor) -> Tensor:
        if torch.jit.is_scripting() or _get_tracing_state() is not None:  # (see FusedLayerNorm.forward)
            return manual_rms_norm(input, self.normalized_shape, self.weight, self.eps)
        return mixed_dtype_fused_rms_norm_affine(input, self._param("weight"), self.normalized_shape, self.eps,
                                                 self.memory_efficient)
