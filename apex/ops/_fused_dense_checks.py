"""The checks of a dense chain (:mod:`apex.ops.fused_dense`): the activation codes, and the validation of the
input, weights and biases, with fast paths for the usual one-layer and MLP calls and errors naming the offending
argument; and :func:`plan_key`, the facts those checks read as one key (the eager path's cached plans')."""

from __future__ import annotations

import torch

from apex._errors import RuntimeTypeError
from apex.ops._checks import member_set
from apex.ops._dispatch import _PLAIN
from apex.ops._norm import _same_device

Tensor = torch.Tensor

ACTIVATIONS = {"none": 0, "relu": 1, "sigmoid": 2, "gelu": 3}
NONE, RELU, SIGMOID, GELU = 0, 1, 2, 3
# A set: a dtype's membership by its hash (a tuple compares it with each entry in turn, ~1 µs a call).
_FLOATS = member_set(torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_chain(input: Tensor, weights, biases, acts, compiling: bool | None = None) -> None:
    """Validate a chain; raise ``TypeError``/``ValueError`` naming the offending argument. ``compiling``:
    ``torch.compiler.is_compiling()`` where the caller has read it already (a query of 1-2k instructions)."""
    # A dtype Apex's fused_dense_cuda / mlp_cuda did not take (AT_DISPATCH, then data_ptr<scalar_t> of every
    # weight and bias) was its RuntimeError: those errors are also one.
    if not (_quick_one_layer(input, weights, biases, acts) if len(weights) == 1 else
            _quick_layers(input, weights, biases, acts)):
        _check_layers(input, weights, biases, acts)
    # A chain's codes are the same every call: checked once. Not while torch.compile traces: the graph would
    # guard on the set, which the next eager call changes (a second graph for the same code).
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if not compiling and acts in _CHECKED_ACTS:
        return
    if any(a not in (NONE, RELU, SIGMOID, GELU) for a in acts):
        raise ValueError(f"activation codes must be 0 (none), 1 (relu), 2 (sigmoid) or 3 (gelu), got {acts}")
    if not compiling and isinstance(acts, tuple) and len(_CHECKED_ACTS) < 256:
        _CHECKED_ACTS.add(acts)


def _quick_one_layer(input: object, weights, biases, acts) -> bool:
    """True for the usual one-layer call (plain tensors of one float dtype on one device, ``[..., in]`` input,
    ``[out, in]`` weight, none or one ``[out]`` bias), each fact read once (~half of the general checks'
    cost); False sends the call to :func:`_check_layers` (and its errors)."""
    if len(weights) != 1 or len(acts) != 1 or type(input) not in _PLAIN:
        return False
    w = weights[0]
    dt = input.dtype
    if type(w) not in _PLAIN or dt not in _FLOATS or w.dtype is not dt:
        return False
    ws, xs = w.shape, input.shape
    if len(ws) != 2 or not xs or xs[-1] != ws[1] or not _same_device(w, input):
        return False
    if biases:
        if len(biases) != 1:
            return False
        b = biases[0]
        if type(b) not in _PLAIN or b.dtype is not dt:
            return False
        bs = b.shape
        # (w is on input's device already: b compared with w by flags and index, without a call)
        return len(bs) == 1 and bs[0] == ws[0] and (b.get_device() == w.get_device() if b.is_cuda
                                                    else b.is_cpu and w.is_cpu)
    return True


def _quick_layers(input: object, weights, biases, acts) -> bool:
    """:func:`_quick_one_layer` for a chain of several layers (the MLP's): each fact read once, no device
    objects; False sends the call to :func:`_check_layers`."""
    n = len(weights)
    if n == 0 or len(acts) != n or type(input) not in _PLAIN:
        return False
    dt = input.dtype
    xs = input.shape
    if dt not in _FLOATS or not xs or (biases and len(biases) != n):
        return False
    features = xs[-1]
    # The input's device facts read once (_same_device would read them again for every weight).
    on_cuda = input.is_cuda
    if on_cuda:
        index = input.get_device()
    elif not input.is_cpu:
        return False
    for i in range(n):
        w = weights[i]
        if type(w) not in _PLAIN or w.dtype is not dt:
            return False
        ws = w.shape
        if len(ws) != 2 or ws[1] != features:
            return False
        if on_cuda:
            if not w.is_cuda or w.get_device() != index:
                return False
        elif not w.is_cpu:
            return False
        features = ws[0]
        if biases:
            b = biases[i]
            if type(b) not in _PLAIN or b.dtype is not dt:
                return False
            bs = b.shape
            if len(bs) != 1 or bs[0] != features:
                return False
            # A bias is read by the kernel's epilogue: a host pointer there is an illegal device access.
            if on_cuda:
                if not b.is_cuda or b.get_device() != index:
                    return False
            elif not b.is_cpu:
                return False
    return True


def _check_layers(input: object, weights, biases, acts) -> None:
    if not isinstance(input, Tensor):
        raise TypeError(f"input must be a torch.Tensor, got {type(input).__name__}")
    dt = input.dtype  # each fact read once, not once per layer
    if dt not in _FLOATS:
        raise RuntimeTypeError(f"input must be a floating-point tensor (fp16, bf16, fp32 or fp64), got {dt}")
    if input.dim() < 1:
        raise ValueError("input must have at least one dimension (its last is the feature dimension)")
    n = len(weights)
    if n == 0:
        raise ValueError("at least one weight is needed")
    if biases is not None and len(biases) not in (0, n):
        raise ValueError(f"expected {n} biases (one per weight) or none, got {len(biases)}")
    if len(acts) != n:
        raise ValueError(f"expected one activation per layer ({n}), got {len(acts)}")
    dev = input.device
    features = input.shape[-1]
    for i in range(n):
        w = weights[i]
        if not isinstance(w, Tensor) or w.dim() != 2:
            raise ValueError(f"weight {i} must be a 2-D tensor [out_features, in_features], got "
                             f"{tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__}")
        out_f, in_f = w.shape
        if in_f != features:
            what = "input's last dimension" if i == 0 else f"weight {i - 1}'s out_features"
            raise ValueError(f"weight {i} expects {in_f} input features but the {what} is {features}")
        if w.dtype != dt:
            raise RuntimeTypeError(f"weight {i} has dtype {w.dtype} but input has {dt}: they must match "
                                   "(use torch.autocast or cast the module)")
        if w.device != dev:
            raise ValueError(f"weight {i} is on {w.device} but input is on {dev}")
        if biases:
            b = biases[i]
            if not isinstance(b, Tensor) or b.dim() != 1 or b.shape[0] != out_f:
                raise ValueError(f"bias {i} must have shape ({out_f},), got "
                                 f"{tuple(b.shape) if isinstance(b, Tensor) else type(b).__name__}")
            if b.dtype != dt:
                raise RuntimeTypeError(f"bias {i} has dtype {b.dtype} but input has {dt}: they must match")
            if b.device != dev:
                raise ValueError(f"bias {i} is on {b.device} but input is on {dev}")
        features = out_f


_CHECKED_ACTS: set = set()


# Plain tensors only (a member_set: a type's membership by its hash): the types plan_key takes.
_PLAIN_TYPES = member_set(torch.Tensor, torch.nn.Parameter)


def plan_key(input: Tensor, weights, biases, acts) -> tuple | None:
    """Every fact :func:`check_chain` reads of a chain of plain tensors, and the strides its launches take: the
    codes, and for the input, each weight and each bias its shape, dtype and device, with the input's and
    the weights' strides; None where a tensor is not a plain ``Tensor``/``Parameter`` (a subclass may answer
    anything) or a bias is not contiguous (the plans read biases at unit stride; the general launcher copies).
    Two calls with equal keys pass or fail the checks alike: a key seen checked needs no check. One flat
    tuple (hashed and compared element by element), spelled out for the usual one- and two-layer chains with
    biases (FusedDense, FusedDenseGeluDense, a two-layer MLP: ~2 µs less than the loop)."""
    n = len(weights)
    if n == len(biases) and 0 < n <= 2:
        if n == 1:
            x, w, b = input, weights[0], biases[0]
            if (type(x) not in _PLAIN_TYPES or type(w) not in _PLAIN_TYPES or type(b) not in _PLAIN_TYPES
                    or not b.is_contiguous()):
                return None
            return (acts, x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device,
                    b.shape, b.dtype, b.device)
        x, (w, v), (b, c) = input, weights, biases
        if (type(x) not in _PLAIN_TYPES or type(w) not in _PLAIN_TYPES or type(v) not in _PLAIN_TYPES
                or type(b) not in _PLAIN_TYPES or type(c) not in _PLAIN_TYPES
                or not (b.is_contiguous() and c.is_contiguous())):
            return None
        return (acts, x.shape, x.stride(), x.dtype, x.device, w.shape, w.stride(), w.dtype, w.device,
                v.shape, v.stride(), v.dtype, v.device, b.shape, b.dtype, b.device, c.shape, c.dtype, c.device)
    if type(input) not in _PLAIN_TYPES:
        return None
    key = [acts, input.shape, input.stride(), input.dtype, input.device]
    for w in weights:
        if type(w) not in _PLAIN_TYPES:
            return None
        key += (w.shape, w.stride(), w.dtype, w.device)
    for b in biases:
        if type(b) not in _PLAIN_TYPES or not b.is_contiguous():
            return None
        key += (b.shape, b.dtype, b.device)
    return tuple(key)
