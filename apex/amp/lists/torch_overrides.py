"""Apex's O1 lists for the ``torch`` namespace (see :mod:`apex.amp.lists`)."""

import torch

MODULE = torch

FP16_FUNCS = [
    # the functions behind the layers that hold weights
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc", "prelu",
    # BLAS
    "addmm", "addmv", "addr", "matmul", "mm", "mv",
]

FP32_FUNCS = [
    # pointwise
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt", "sinh", "tan",
    # other math
    "pow",
    # reductions
    "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var",
    # misc
    "renorm",
]

# Batched matmuls are half-precision functions in a build with a GPU runtime (Apex: CUDA 9.1 and later, the
# first with fast fp16 batched kernels), and on neither list otherwise.
if torch.version.cuda is not None or torch.version.hip is not None:
    FP16_FUNCS.extend(["addbmm", "baddbmm", "bmm"])

# Functions of several tensors whose floating-point arguments are promoted to the widest type.
CASTS = [
    "addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot",
    "add", "div", "mul",
    "eq", "equal", "ge", "gt", "le", "lt", "ne",
]

# Functions taking a sequence of tensors, promoted to the widest type among them.
SEQUENCE_CASTS = ["cat", "stack"]

_DEFAULTS = {name: tuple(globals()[name]) for name in ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS")}
