"""Flat collectives shared by DistributedDataParallel and Reducer (Apex's helpers of
``apex.parallel.distributed``), and the check that a process group exists.

A rank that dies or hangs makes the others fail with PyTorch's timeout error after the ``timeout=``
passed to ``torch.distributed.init_process_group``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn import Module


def require_process_group(what: str) -> None:
    """Raise the RuntimeError every distributed entry point gives when no process group exists."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs an initialised process group: call "
                           "torch.distributed.init_process_group(backend, ...) first (for example "
                           "backend='gloo' on CPU or 'nccl' on GPUs, under torchrun)")


def flatten(bucket: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate same-dtype tensors into one contiguous 1-D tensor."""
    return _flatten_dense_tensors(bucket)


def unflatten(coalesced: torch.Tensor, bucket: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``coalesced`` shaped like the tensors of ``bucket`` (the inverse of :func:`flatten`)."""
    return _unflatten_dense_tensors(coalesced, bucket)


def apply_flat_dist_call(bucket: list[torch.Tensor], call, extra_args=None) -> None:
    """Flatten ``bucket`` (one dtype), run ``call(flat, *extra_args)``, copy the result back.

    After ``dist.all_reduce`` the result is divided by the world size (Apex's averaging).
    """
    coalesced = flatten(bucket)
    if extra_args is not None:
        call(coalesced, *extra_args)
    else:
        call(coalesced)
    if call is dist.all_reduce:
        coalesced /= dist.get_world_size()
    for buf, synced in zip(bucket, unflatten(coalesced, bucket)):
        buf.copy_(synced)


def split_half_float_double(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors by dtype: fp16, bf16, fp32, fp64 (in that order), dropping empty groups."""
    tensors = list(tensors)
    order = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    buckets = [[t for t in tensors if t.dtype == dt] for dt in order]
    return [b for b in buckets if b]


def split_by_type(tensors: Iterable[torch.Tensor]) -> OrderedDict:
    """``OrderedDict`` of ``tensor.type()`` -> tensors, in order of first appearance."""
    buckets: OrderedDict = OrderedDict()
    for t in tensors:
        buckets.setdefault(t.type(), []).append(t)
    return buckets


def flat_dist_call(tensors: Iterable[torch.Tensor], call, extra_args=None) -> None:
    """:func:`apply_flat_dist_call` once per tensor type."""
    for bucket in split_by_type(tensors).values():
        apply_flat_dist_call(bucket, call, extra_args)


def extract_tensors(maybe_tensor, tensor_list: list) -> None:
    """Append every tensor found in ``maybe_tensor`` (a tensor or nested iterables of them) to ``tensor_list``."""
    if torch.is_tensor(maybe_tensor):
        tensor_list.append(maybe_tensor)
        return
    try:
        for item in maybe_tensor:
            extract_tensors(item, tensor_list)
    except TypeError:
        return


def _group_src(group) -> int:
    """Global rank of rank 0 of ``group`` (the broadcast source)."""
    if group is None:
        return 0
    return dist.get_global_rank(group, 0)


def _broadcast_params(params: list[torch.Tensor], group) -> None:
    src = _group_src(group)
    for bucket in split_by_type(p.detach() for p in params).values():
        apply_flat_dist_call(bucket, dist.broadcast, (src, group))


class Reducer:
    """All-reduce (average) a module's gradients, or a list of tensors, when :meth:`reduce` is called.

    Unlike :class:`DistributedDataParallel` nothing happens during ``backward()``: call ``reduce()``
    yourself, for example every few iterations. Given a module, its parameters are broadcast from rank 0
    at construction; given tensors (any nesting of lists), keeping them in sync is up to the caller.
    ``reduce()`` replaces every tensor by the average over the ranks (sum / world size).
    """

    def __init__(self, module_or_grads_list):
        require_process_group("apex.parallel.Reducer")
        if isinstance(module_or_grads_list, Module):
            self.module = module_or_grads_list
            _broadcast_params(list(self.module.parameters()), None)
        else:
            self.module = None
            self.grads: list[torch.Tensor] = []
            extract_tensors(module_or_grads_list, self.grads)

    def reduce(self) -> None:
        if self.module is not None:
            grads = [p.grad.data for p in self.module.parameters() if p.grad is not None]
        else:
            grads = self.grads
        flat_dist_call(grads, dist.all_reduce)
