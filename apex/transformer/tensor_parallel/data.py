"""Broadcast a batch from the first rank of each tensor-parallel group to the others."""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex._errors import AssertTypeError, AssertValueError
from apex.transformer.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_src_rank,
)
from apex.transformer.utils import _current_device

_MAX_DATA_DIM = 5


def _check_data_types(keys, data, target_dtype) -> None:
    """Every ``data[key]`` must have ``target_dtype``."""
    for key in keys:
        if data[key].dtype != target_dtype:
            raise AssertTypeError(f"{key} has data type {data[key].dtype} which is different than {target_dtype}")


def _build_key_size_numel_dictionaries(keys, data):
    """Broadcast the shapes of ``data[key]`` from the source rank; returns (sizes, numels, total numel)."""
    sizes = [0] * (_MAX_DATA_DIM * len(keys))
    if get_tensor_model_parallel_rank() == 0:
        for k, key in enumerate(keys):
            if data[key].dim() >= _MAX_DATA_DIM:
                raise AssertValueError(f"{key} has {data[key].dim()} dimensions; at most {_MAX_DATA_DIM - 1} are "
                                       "supported")
            for i, s in enumerate(data[key].shape):
                sizes[k * _MAX_DATA_DIM + i] = s
    sizes_t = torch.tensor(sizes, dtype=torch.long, device=_current_device())
    dist.broadcast(sizes_t, get_tensor_model_parallel_src_rank(), group=get_tensor_model_parallel_group())
    sizes = sizes_t.cpu().tolist()
    key_size, key_numel, total = {}, {}, 0
    for k, key in enumerate(keys):
        size = []
        for s in sizes[k * _MAX_DATA_DIM:(k + 1) * _MAX_DATA_DIM]:
            if s <= 0:
                break
            size.append(s)
        numel = 1
        for s in size:
            numel *= s
        key_size[key], key_numel[key] = size, numel
        total += numel
    return key_size, key_numel, total


def broadcast_data(keys, data, datatype):
    """Broadcast ``data[key]`` for ``keys`` from the tensor-parallel source rank (other ranks may pass
    ``data=None``); all tensors must have ``datatype``. Returns a dict of tensors on the current device."""
    if get_tensor_model_parallel_rank() == 0:
        _check_data_types(keys, data, datatype)
    key_size, key_numel, total = _build_key_size_numel_dictionaries(keys, data)
    device = _current_device()
    if get_tensor_model_parallel_rank() == 0:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys]).to(device)
    else:
        flat = torch.empty(total, device=device, dtype=datatype)
    dist.broadcast(flat, get_tensor_model_parallel_src_rank(), group=get_tensor_model_parallel_group())
    out, offset = {}, 0
    for key in keys:
        out[key] = flat.narrow(0, offset, key_numel[key]).view(key_size[key])
        offset += key_numel[key]
    return out
