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


# Gradient layouts of a (3, 1, 40) output: the backward reads a contiguous gradient in place whatever its shape
# (a size-1 dimension's stride does not count) and any other through a 2-D view or copy.
GRAD_LAYOUTS = ["contiguous", "size1_stride", "expanded", "row_gap", "permuted"]


def grad_like(layout):
    """A (3, 1, 40) gradient in ``layout`` (one of GRAD_LAYOUTS)."""
    if layout == "contiguous":
        return torch.randn(3, 1, 40)
    if layout == "size1_stride":
        g = torch.randn(3, 40).as_strided((3, 1, 40), (40, 7, 1))
        assert g.is_contiguous()
        return g
    if layout == "expanded":  # what y.sum() hands back: a zero row stride
        return torch.randn(1, 1, 40).expand(3, 1, 40)
    if layout == "row_gap":
        return torch.randn(3, 1, 50)[..., :40]
    return torch.randn(1, 3, 40).transpose(0, 1)  # "permuted"
