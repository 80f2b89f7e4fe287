"""Shapes, dtypes and helpers shared by the layer_norm and rms_norm op tests."""

import contextlib

import torch

from apex.testing import TritonTrace

# (input shape, normalized_shape)
SHAPES = [((1, 1), (1,)), ((3, 7), (7,)), ((17, 4097), (4097,)), ((2, 5, 768), (768,)), ((3, 4, 6), (4, 6))]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def trace(backend_name, *tensors):
    """A bounds-checking TritonTrace watching ``tensors`` on the Triton backend; nothing on the other."""
    if backend_name != "triton":
        return contextlib.nullcontext(None)
    tr = TritonTrace(bounds=True)
    tr.watch(*tensors)
    return tr


def run(fn, x, w, dy, *extra):
    """``fn()`` and its gradients with respect to ``x``, ``w`` and ``extra`` (those that are not None)."""
    leaves = [x] + ([w] if w is not None else []) + [e for e in extra if e is not None]
    y = fn()
    return y, torch.autograd.grad(y, leaves, dy)
