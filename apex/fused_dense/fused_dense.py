"""Apex's fused dense layers: ``FusedDense`` (``x Wᵀ + b``, the bias in the GEMM's epilogue and its gradient
reduced inside the weight-gradient GEMM) and ``FusedDenseGeluDense`` (``gelu(x W₁ᵀ + b₁) W₂ᵀ + b₂``, the
GELU being the tanh approximation, cuBLASLt's).

Differences from Apex: weights are initialised as ``nn.Linear`` does (Apex left them uninitialised); the
input may have any leading dimensions (``[..., in_features]``); ``FusedDenseGeluDense(bias=False)`` raises
``ValueError`` (Apex asserted). Under ``torch.autocast`` the input and parameters are cast to the autocast
dtype; otherwise they must share one dtype.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from apex._errors import AssertValueError
from apex.ops._dense_direct import chain as _lean_chain
from apex.ops._dense_direct import dense as _lean_dense
from apex.ops.fused_dense import GELU, NONE, apply_chain, apply_general, chain_grads, save_chain


class FusedDenseFunc(torch.autograd.Function):
    """``FusedDenseFunc.apply(input, weight, bias)`` = ``input @ weightᵀ + bias``."""

    @staticmethod
    def forward(ctx, input, weight, bias):
        return save_chain(ctx, (NONE,), True, input, (weight, bias))

    @staticmethod
    def backward(ctx, grad_output):
        dx, dws, dbs = chain_grads(ctx, grad_output, 0)
        return dx, dws[0], dbs[0]


class DenseNoBiasFunc(torch.autograd.Function):
    """``DenseNoBiasFunc.apply(input, weight)`` = ``input @ weightᵀ``."""

    @staticmethod
    def forward(ctx, input, weight):
        return save_chain(ctx, (NONE,), False, input, (weight,))

    @staticmethod
    def backward(ctx, grad_output):
        dx, dws, _ = chain_grads(ctx, grad_output, 0)
        return dx, dws[0]


class FusedDenseGeluDenseFunc(torch.autograd.Function):
    """``FusedDenseGeluDenseFunc.apply(input, weight1, bias1, weight2, bias2)``."""

    @staticmethod
    def forward(ctx, input, weight1, bias1, weight2, bias2):
        return save_chain(ctx, (GELU, NONE), True, input, (weight1, weight2, bias1, bias2))

    @staticmethod
    def backward(ctx, grad_output):
        dx, dws, dbs = chain_grads(ctx, grad_output, 0)
        return dx, dws[0], dbs[0], dws[1], dbs[1]


# The chains' slices of (input, *params): the weights', the biases'.
_ONE = (slice(1, 2), slice(2, 3))
_NO_BIAS = (slice(1, 2), slice(2, 2))
_GELU_DENSE = (slice(1, 5, 2), slice(2, 5, 2))
_ACT_NONE = (NONE,)
_ACTS_GELU_DENSE = (GELU, NONE)


def fused_dense_function(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``input @ weightᵀ + bias`` (Apex's ``_fused_dense``); autocast-aware, checked."""
    if bias is None:
        return apply_chain(DenseNoBiasFunc, (), (input, weight), *_NO_BIAS, _ACT_NONE)
    return apply_chain(FusedDenseFunc, (), (input, weight, bias), *_ONE, _ACT_NONE)


def dense_no_bias_function(input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``input @ weightᵀ`` (Apex's ``_dense_no_bias``)."""
    return apply_chain(DenseNoBiasFunc, (), (input, weight), *_NO_BIAS, _ACT_NONE)


def fused_dense_gelu_dense_function(input: torch.Tensor, weight1: torch.Tensor, bias1: torch.Tensor,
                                    weight2: torch.Tensor, bias2: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(input @ weight1ᵀ + bias1) @ weight2ᵀ + bias2`` (Apex's ``_fused_dense_gelu_dense``)."""
    if bias1 is None or bias2 is None:
        raise ValueError("bias1 and bias2 are required: FusedDenseGeluDense has no bias-free form")
    return apply_chain(FusedDenseGeluDenseFunc, (), (input, weight1, bias1, weight2, bias2), *_GELU_DENSE,
                       _ACTS_GELU_DENSE)


def _registered(module: nn.Module, names: tuple[str, ...]) -> list:
    """The module's parameters ``names`` read from ``_parameters`` (``nn.Module.__getattr__`` costs ~1 µs a
    parameter, every call); anything else (a parametrization's property, an attribute a wrapper put in a
    parameter's place) by the ordinary lookup."""
    params = module._parameters
    try:
        return [params[name] for name in names]
    except KeyError:
        return [getattr(module, name) for name in names]


# Apex's private names for the functional wrappers.
_fused_dense = fused_dense_function
_dense_no_bias = dense_no_bias_function
_fused_dense_gelu_dense = fused_dense_gelu_dense_function


def _features(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _init_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    # nn.Linear's initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for both (kaiming_uniform with a=sqrt(5)).
    with torch.no_grad():
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if bias is not None:
            bound = 1.0 / math.sqrt(weight.shape[1]) if weight.shape[1] > 0 else 0.0
            nn.init.uniform_(bias, -bound, bound)


class FusedDense(nn.Module):
    """``y = x Wᵀ + b`` with ``W`` of shape ``[out_features, in_features]``; ``bias=False`` drops ``b``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features = _features("in_features", in_features)
        self.out_features = _features("out_features", out_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear(self.weight, self.bias)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # as _registered, inline (a call and a comprehension less)
        try:
            weight, bias = params["weight"], params["bias"]
        except KeyError:
            weight, bias = self.weight, self.bias
        # The plan of the call's layout first (apex.ops._dense_direct), else the general path.
        out = _lean_dense(input, weight, bias)
        if out is not None:
            return out
        if bias is not None:
            return apply_general(FusedDenseFunc, (), (input, weight, bias), *_ONE, _ACT_NONE)
        return apply_general(DenseNoBiasFunc, (), (input, weight), *_NO_BIAS, _ACT_NONE)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


_GELU_DENSE_NAMES = ("weight1", "bias1", "weight2", "bias2")


class FusedDenseGeluDense(nn.Module):
    """``y = gelu_tanh(x W₁ᵀ + b₁) W₂ᵀ + b₂``; ``W₁``: ``[intermediate, in]``, ``W₂``: ``[out, intermediate]``."""

    def __init__(self, in_features: int, intermediate_features: int, out_features: int, bias: bool = True):
        super().__init__()
        if not bias:  # Apex: assert bias == True
            raise AssertValueError("bias=False is not supported: FusedDenseGeluDense always has bias1 and bias2 "
                                   "(as Apex's)")
        self.in_features = _features("in_features", in_features)
        self.intermediate_features = _features("intermediate_features", intermediate_features)
        self.out_features = _features("out_features", out_features)
        self.weight1 = nn.Parameter(torch.empty(intermediate_features, in_features))
        self.bias1 = nn.Parameter(torch.empty(intermediate_features))
        self.weight2 = nn.Parameter(torch.empty(out_features, intermediate_features))
        self.bias2 = nn.Parameter(torch.empty(out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_linear(self.weight1, self.bias1)
        _init_linear(self.weight2, self.bias2)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w1, b1, w2, b2 = _registered(self, _GELU_DENSE_NAMES)
        if not torch.compiler.is_compiling():  # (as FusedDense.forward)
            out = _lean_chain(_ACTS_GELU_DENSE, (input, w1, w2, b1, b2), 2)
            if out is not None:
                return out
        return fused_dense_gelu_dense_function(input, w1, b1, w2, b2)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, intermediate_features={self.intermediate_features}, "
                f"out_features={self.out_features}")
