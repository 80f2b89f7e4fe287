"""Apex's fused optimizers: one multi-tensor update per (device, dtype) group on GPUs (Triton), PyTorch's
fused/foreach operators on CPUs."""

from __future__ import annotations

import importlib

from apex.optimizers.fused_adagrad import FusedAdagrad
from apex.optimizers.fused_adam import FusedAdam
from apex.optimizers.fused_lars import Fused_LARS, FusedLARS
from apex.optimizers.fused_sgd import FusedSGD

# Optimizers living in their own modules, resolved on first access under Apex's module names.
_LAZY = {
    "FusedLAMB": "apex.optimizers.fused_lamb",
    "FusedNovoGrad": "apex.optimizers.fused_novograd",
    "FusedMixedPrecisionLamb": "apex.optimizers.fused_mixed_precision_lamb",
}

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLARS", "FusedSGD", "Fused_LARS"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'apex.optimizers' has no attribute {name!r}")
    try:
        value = getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise AttributeError(f"module 'apex.optimizers' has no attribute {name!r}") from e
    globals()[name] = value
    return value
