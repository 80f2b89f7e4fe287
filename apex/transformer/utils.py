"""Helpers shared by ``pipeline_parallel`` and ``tensor_parallel``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex._errors import AssertValueError
from apex.transformer import parallel_state


def ensure_divisibility(numerator: int, denominator: int) -> None:
    """Raise ``ValueError`` (also the ``AssertionError`` Apex raised) unless ``numerator`` is divisible by
    ``denominator``."""
    if denominator == 0 or numerator % denominator != 0:
        raise AssertValueError(f"{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int) -> int:
    """``numerator // denominator``, checking that the division is exact (see :func:`ensure_divisibility`)."""
    ensure_divisibility(numerator, denominator)
    return numerator // denominator


def split_tensor_into_1d_equal_chunks(tensor: torch.Tensor) -> torch.Tensor:
    """This tensor-parallel rank's equal slice of ``tensor`` flattened (a view)."""
    data = tensor.view(-1)
    size = data.numel() // parallel_state.get_tensor_model_parallel_world_size()
    start = size * parallel_state.get_tensor_model_parallel_rank()
    return data[start:start + size]


def gather_split_1d_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_tensor_into_1d_equal_chunks`: all-gather the 1-D slices of the tensor group."""
    world_size = parallel_state.get_tensor_model_parallel_world_size()
    gathered = torch.empty(world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    dist.all_gather_into_tensor(gathered, tensor.contiguous().view(-1),
                                group=parallel_state.get_tensor_model_parallel_group())
    return gathered


def _current_device() -> torch.device:
    """The device upstream would allocate on (``torch.cuda.current_device()``), or the CPU without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
