"""Apex's ``MLP``: ``y = act(… act(act(x W₀ᵀ + b₀) W₁ᵀ + b₁) …)``, the activation after every layer.

Each layer is one fused GEMM (bias and activation in its epilogue on GPUs, ``torch.addmm`` with the
activation in place on CPUs); see :mod:`apex.ops.fused_dense`. Differences from Apex: the input may have
any leading dimensions (``[..., mlp_sizes[0]]``, Apex required 2-D); bf16 works on every path; fp64 runs
on the PyTorch path. Under ``torch.autocast`` the input and parameters are cast to the autocast dtype.
"""

from __future__ import annotations

import math
from copy import copy
from operator import itemgetter

import torch
from torch import nn

from apex.ops._dense_direct import chain as _lean_chain
from apex.ops._dispatch import kept_per_key
from apex.ops.fused_dense import apply_chain, apply_general, chain_grads, save_chain

_is_compiling = torch.compiler.is_compiling

_CODES = {"none": 0, "relu": 1, "sigmoid": 2}


class MlpFunction(torch.autograd.Function):
    """``MlpFunction.apply(bias, activation, input, *weights, *biases)`` (Apex's signature): ``bias`` is 0/1,
    ``activation`` 0 (none), 1 (relu) or 2 (sigmoid)."""

    @staticmethod
    def forward(ctx, bias, activation, *args):
        n = (len(args) - 1) // 2 if bias else len(args) - 1
        return save_chain(ctx, (int(activation),) * n, bool(bias), args[0], args[1:])

    @staticmethod
    def backward(ctx, grad_o):
        dx, dws, dbs = chain_grads(ctx, grad_o, 2)
        return (None, None, dx, *dws, *dbs)


def mlp_function(bias, activation, *args) -> torch.Tensor:
    """Differentiable MLP on ``args = (input, *weights, *biases)``; autocast-aware, checked."""
    if activation not in (0, 1, 2):
        raise ValueError(f"activation must be 0 (none), 1 (relu) or 2 (sigmoid), got {activation!r}")
    if not args:
        raise ValueError("mlp_function needs an input and at least one weight")
    n = len(args) - 1
    if bias:
        if n % 2:
            raise ValueError(f"with bias, args must be (input, *weights, *biases); got {len(args)} tensors")
        n //= 2
    return apply_chain(MlpFunction, (bias, activation), args, *_layout(n, bool(bias), int(activation)))


@kept_per_key
def _layout(n: int, bias: bool, activation: int) -> tuple[slice, slice, tuple[int, ...]]:
    """The weights' and biases' slices of ``(input, *weights, *biases)`` and the activation codes of an MLP of
    ``n`` layers: the same for every call of one MLP."""
    return slice(1, 1 + n), slice(1 + n, 1 + 2 * n) if bias else slice(1, 1), (activation,) * n


@kept_per_key
def _names(n: int, bias: bool) -> tuple[str, ...]:
    return tuple(f"weight_{i}" for i in range(n)) + (tuple(f"bias_{i}" for i in range(n)) if bias else ())


@kept_per_key
def _module_plan(n: int, bias: bool, activation: int) -> tuple:
    """A getter of an MLP module's parameters from ``_parameters`` (one C call for all of them) and
    :func:`_layout`, in one lookup per call."""
    names = _names(n, bias)
    # (itemgetter of one name returns the item itself, not a 1-tuple)
    get = itemgetter(*names) if len(names) > 1 else (lambda params: (params[names[0]],))
    return get, _layout(n, bias, activation)


# _module_plan's answers for eager calls (not read or filled while tracing: a graph would guard on it); a few
# keys per program (layer count, bias, activation).
_MODULE_PLANS: dict = {}


class MLP(nn.Module):
    """Multi-layer perceptron with fused GEMM + bias + activation layers.

    Args:
        mlp_sizes: feature sizes, input first: ``[480, 1024, 1]`` makes two layers, 480→1024→1.
        bias: add a bias to every layer.
        activation: ``'none'``, ``'relu'`` or ``'sigmoid'``, applied after every layer, the last included.

    Parameters ``weight_i`` (``[mlp_sizes[i+1], mlp_sizes[i]]``) and ``bias_i``; ``weights`` and ``biases``
    list them. Initialisation (Apex's): weights ``N(0, 2/(fan_in + fan_out))``, biases ``N(0, 1/fan_out)``.
    """

    def __init__(self, mlp_sizes, bias: bool = True, activation: str = "relu"):
        super().__init__()
        sizes = list(mlp_sizes) if isinstance(mlp_sizes, (list, tuple)) else None
        if not sizes or len(sizes) < 2 or any(not isinstance(s, int) or isinstance(s, bool) or s < 1
                                               for s in sizes):
            raise ValueError(f"mlp_sizes must be a list of at least two positive ints, got {mlp_sizes!r}")
        if activation not in _CODES:
            raise TypeError(f"activation must be 'none', 'relu' or 'sigmoid', got {activation!r}")
        self.num_layers = len(sizes) - 1
        self.mlp_sizes = copy(sizes)
        self.bias = 1 if bias else 0
        self.activation = _CODES[activation]
        for i in range(self.num_layers):
            setattr(self, f"weight_{i}", nn.Parameter(torch.empty(sizes[i + 1], sizes[i])))
            if self.bias:
                setattr(self, f"bias_{i}", nn.Parameter(torch.empty(sizes[i + 1])))
        self.reset_parameters()

    @property
    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight_{i}") for i in range(self.num_layers)]

    @property
    def biases(self) -> list[nn.Parameter]:
        return [getattr(self, f"bias_{i}") for i in range(self.num_layers)] if self.bias else []

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for w in self.weights:
                nn.init.normal_(w, 0.0, math.sqrt(2.0 / float(w.size(0) + w.size(1))))
            for b in self.biases:
                nn.init.normal_(b, 0.0, math.sqrt(1.0 / float(b.size(0))))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        # The parameters read from _parameters (nn.Module.__getattr__ costs ~1 µs a parameter, every call);
        # anything else (a parametrization's property, say) by the ordinary lookup.
        # mlp_function's work for the module's own arguments: its layout and names in one lookup, the
        # activation checked (an attribute a caller may have changed), no re-count of the tensors.
        bias, activation, n = self.bias, self.activation, self.num_layers
        if activation not in (0, 1, 2):
            raise ValueError(f"activation must be 0 (none), 1 (relu) or 2 (sigmoid), got {activation!r}")
        # The tracing query once a call (kept_per_key would ask it again).
        compiling = _is_compiling()
        # (kept by the attributes as they are: equal values, bool(bias) and int(activation) equal, hash alike)
        plan = None if compiling else _MODULE_PLANS.get((n, bias, activation))
        if plan is None:
            plan = _module_plan(n, bool(bias), int(activation))
            if not compiling:
                _MODULE_PLANS[(n, bias, activation)] = plan
        get, layout = plan
        try:
            args = (input, *get(self._parameters))
        except KeyError:
            args = (input, *self.weights, *self.biases)
        # The plan of the call's layout first (apex.ops._dense_direct), else the general path.
        if not compiling:
            out = _lean_chain(layout[2], args, n)
            if out is not None:
                return out
        return apply_general(MlpFunction, (bias, activation), args, *layout, compiling)

    def extra_repr(self) -> str:
        return f"MLP sizes: {self.mlp_sizes}, Bias={self.bias}, activation={self.activation}"
