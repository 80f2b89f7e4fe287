"""Process-wide amp state, shared by ``initialize``, ``scale_loss`` and the checkpoint functions.

Apex keeps one ``_amp_state`` object per process and so do we: ``amp.initialize`` configures it and every
other ``amp.*`` call reads it. The object is reset by each ``initialize`` call.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

CPU_HALF_ENV = "APEX_AMP_CPU_HALF"
_CPU_HALF_VALUES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
                    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}


class AmpState:
    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1


_amp_state = AmpState()


def default_half_dtype(device_type: str) -> torch.dtype:
    """The half type of O1-O3 when the call names none: fp16 on CUDA; on other devices bf16, or fp16 when
    the environment variable ``APEX_AMP_CPU_HALF=fp16`` is set (read at each ``amp.initialize``/``amp.init``),
    which makes CPU runs use Apex's CUDA dtype (fp16 casts, fp16 overflows, dynamic loss scaling of fp16).
    """
    if device_type == "cuda":
        return torch.float16
    value = os.environ.get(CPU_HALF_ENV, "").strip().lower() or "bf16"
    if value not in _CPU_HALF_VALUES:
        raise ValueError(f"environment variable {CPU_HALF_ENV} must be 'fp16' or 'bf16' (or 'float16', 'half', "
                         f"'bfloat16'), got {os.environ[CPU_HALF_ENV]!r}")
    return _CPU_HALF_VALUES[value]


def warn_or_err(msg: str) -> None:
    """Raise ``RuntimeError(msg)``, or only print it when ``_amp_state.hard_override`` is set."""
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Print ``msg`` when ``verbosity > 0`` (only on rank 0 of a process group when ``rank0``)."""
    if _amp_state.verbosity <= 0:
        return
    if rank0:
        distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and torch.distributed.get_world_size() > 1)
        if distributed and torch.distributed.get_rank() != 0:
            return
    print(msg)


def master_params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Iterate over the parameters owned by ``optimizer`` (the fp32 master copies under O2).

    Args:
        optimizer: an optimizer returned by ``amp.initialize``.
    """
    for group in optimizer.param_groups:
        yield from group["params"]
