"""apex.transformer: Megatron-LM's model-parallel toolkit (tensor, pipeline and data parallelism) on
``torch.distributed`` with any backend (NCCL on GPUs, Gloo on CPUs), and its fused kernels.

Importing it is cheap: the subpackages are imported on first attribute access, as upstream's eager
imports would have made them available.
"""

from __future__ import annotations

import importlib
from typing import Any

from apex.transformer.enums import AttnMaskType, AttnType, LayerType

_SUBMODULES = ("amp", "functional", "parallel_state", "pipeline_parallel", "tensor_parallel", "utils")

__all__ = [*_SUBMODULES, "LayerType", "AttnType", "AttnMaskType"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"apex.transformer.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'apex.transformer' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
