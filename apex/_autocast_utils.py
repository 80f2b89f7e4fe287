"""Autocast helpers for functions that bypass autocast (custom autograd Functions / custom ops).

``_cast_if_autocast_enabled(*args)`` returns ``args`` unchanged when autocast is off, else a tuple in which every
floating-point tensor on an autocast-enabled device (CUDA or CPU) is cast to that device's autocast dtype
(recursing into lists, tuples and dicts; other values pass through). Imports only torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["_cast_if_autocast_enabled"]


def _enabled_dtypes() -> dict:
    """``{device_type: autocast dtype}`` for the devices where autocast is on now."""
    out = {}
    for device_type in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device_type):
            out[device_type] = torch.get_autocast_dtype(device_type)
    return out


def _get_autocast_dtypes() -> Sequence[torch.dtype]:
    """Low-precision dtypes autocast can use here: fp16, plus bf16 where the GPU (or the CPU path) has it."""
    if not torch.cuda.is_available() or torch.cuda.is_bf16_supported():
        return [torch.half, torch.bfloat16]
    return [torch.half]


def _get_current_dtype(dtype: torch.dtype | None = None) -> torch.dtype:
    """The autocast dtype (CUDA first, then CPU) when autocast is on, else float32 — as upstream, ``dtype`` is
    ignored when autocast is off."""
    enabled = _enabled_dtypes()
    if not enabled:
        return torch.float
    return enabled.get("cuda", enabled.get("cpu"))


def _cast(value: Any, dtypes: dict) -> Any:
    if isinstance(value, torch.Tensor):
        dtype = dtypes.get(value.device.type)
        if dtype is not None and value.is_floating_point() and value.dtype != torch.float64:
            return value.to(dtype)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtypes) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtypes) for k, v in value.items()}
    return value


def _cast_if_autocast_enabled(*args: Any) -> tuple:
    dtypes = _enabled_dtypes()
    if not dtypes:
        return args
    return _cast(args, dtypes)
