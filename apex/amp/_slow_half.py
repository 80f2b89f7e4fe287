"""The once-per-process warning of ``amp.initialize`` when the half type it was asked for is emulated.

Apex's semantics stand: amp computes in the half type it was asked for, even where that is slow. But a user
whose CPU has no bf16 hardware (no AVX512-BF16 or AMX) should learn, once, how much slower it will be --
measured on this machine at that moment, not guessed -- and how to get fp32 instead.
"""

from __future__ import annotations

import warnings

import torch

from apex import _hardware
from apex.amp._amp_state import _amp_state

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class SlowHalfWarning(UserWarning):
    """The half type amp will compute in has no hardware support on the model's device."""


def warn_if_slow(device_type: str, dtype: torch.dtype, opt_level: str) -> bool:
    """Warn (once per process and (device type, dtype)) when ``dtype`` is not fast on ``device_type``.

    Returns True when it warned now.
    """
    if device_type not in ("cpu", "cuda") or dtype not in _NAMES:
        return False
    if _hardware.has_fast_half(device_type, dtype):
        return False
    warned = _amp_state.__dict__.setdefault("slow_half_warned", set())
    key = (device_type, dtype)
    if key in warned:
        return False
    warned.add(key)
    cap = _hardware.capability(device_type)
    try:
        measured = _hardware.measure_slowdown(dtype, device_type).describe()
    except RuntimeError as exc:  # never let the measurement break initialize
        measured = f"the slowdown could not be measured ({exc})"
    where = "this CPU" if device_type == "cpu" else "this GPU"
    name = _NAMES[dtype]
    warnings.warn(
        f"amp.initialize(opt_level={opt_level!r}) computes in {name}, but {where} ({cap.name}) has no "
        f"{name} hardware ({cap.reason}): {measured}. Training will run, as asked, but slower than in fp32. "
        f"For fp32 pass opt_level=\"O0\"; python -m apex lists the dtypes each device computes at full speed.",
        SlowHalfWarning, stacklevel=3)
    return True
