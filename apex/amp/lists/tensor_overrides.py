"""Apex's O1 lists for ``torch.Tensor`` methods (see :mod:`apex.amp.lists`): its own entries, then every
``torch_overrides`` entry that is also a Tensor method (taken when this module is imported, as in Apex)."""

import torch

from apex.amp.lists import torch_overrides

MODULE = torch.Tensor


def _present(names):
    return [name for name in names if hasattr(MODULE, name)]


FP16_FUNCS = _present(["__matmul__"])

FP32_FUNCS = _present([
    "__ipow__", "__pow__", "__rpow__",
    "cpu",  # a half tensor copied to the host arrives in fp32
])

CASTS = _present([
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__", "__isub__",
    "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__", "__rmul__", "__rsub__",
    "__rtruediv__", "__sub__", "__truediv__",
])

SEQUENCE_CASTS: list = []

for _name in ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS"):
    globals()[_name].extend(_present(getattr(torch_overrides, _name)))

_DEFAULTS = {name: tuple(globals()[name]) for name in ("FP16_FUNCS", "FP32_FUNCS", "CASTS", "SEQUENCE_CASTS")}
