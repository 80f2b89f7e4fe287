"""``init``, ``create_nccl_mem_pool`` and the ``nccl_mem`` context manager, with Apex's signatures.

Apex compiled a ``CUDAPluggableAllocator`` around ``ncclMemAlloc``/``ncclMemFree``. PyTorch now exposes
the same allocator itself (``ProcessGroupNCCL``'s ``mem_allocator``), so no extension is needed:

* With CUDA and an initialised NCCL process group, :func:`get_nccl_allocator` is that ``ncclMemAlloc``
  allocator and :func:`create_nccl_mem_pool` a ``torch.cuda.MemPool`` over it; inside ``nccl_mem(pool)``
  CUDA allocations come from the pool, and on exit the pool is registered with the group's NCCL backend
  (as Apex did). With CUDA but no NCCL process group yet, the pool uses PyTorch's caching allocator
  (a private pool; NCCL user-buffer registration still works, NVLS does not get ``ncclMemAlloc`` memory).
* Without CUDA (CPU-only builds, CPU tensors) everything is a documented no-op: ``create_nccl_mem_pool``
  returns ``None`` and ``nccl_mem`` changes nothing, so allocations proceed normally and code written
  for Apex runs unchanged.
"""

from __future__ import annotations

import inspect
import os
from contextlib import nullcontext

import torch

from apex._errors import AssertValueError

__all__ = ["init", "nccl_mem", "create_nccl_mem_pool"]


def _cuda() -> bool:
    return torch.cuda.is_available()


def _nccl_group(group=None):
    """The NCCL process group to take the allocator from, or ``None`` where there is none."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_nccl_available()):
        return None
    if group is None:
        if not dist.is_initialized():
            return None
        group = dist.distributed_c10d._get_default_group()
    return group


def get_nccl_allocator():
    """``_apex_nccl_allocator.get_nccl_allocator()``: the ``ncclMemAlloc`` allocator of the default NCCL
    process group's backend, or ``None`` (meaning PyTorch's default CUDA allocator) where CUDA, NCCL or an
    initialised NCCL process group is missing."""
    if not _cuda():
        return None
    group = _nccl_group()
    if group is None:
        return None
    try:
        backend = group._get_backend(torch.device("cuda", torch.cuda.current_device()))
        return backend.mem_allocator
    except (RuntimeError, AttributeError):
        # A group without an NCCL backend for this device (e.g. Gloo only) has no ncclMemAlloc allocator.
        return None


def get_nccl_version() -> tuple[int, int]:
    """``_nccl_version_getter.get_nccl_version()``: ``(major, minor)`` of the NCCL PyTorch was built with.

    Raises RuntimeError on builds without NCCL (CPU-only PyTorch), where there is no version to report.
    """
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError) as err:
        raise RuntimeError("NCCL is not available: this PyTorch build has no CUDA/NCCL support") from err
    return int(version[0]), int(version[1])


def create_nccl_mem_pool(symmetric: bool | None = None):
    """A ``torch.cuda.MemPool`` over :func:`get_nccl_allocator`, or ``None`` without CUDA (no-op pool).

    ``symmetric`` (Apex's newer argument) asks for a symmetric-memory pool; it is passed to
    ``torch.cuda.MemPool`` under the name this PyTorch uses and raises ValueError where it has none.
    """
    if symmetric is not None and not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be a bool or None, got {type(symmetric).__name__}")
    if not _cuda():
        return None
    allocator = get_nccl_allocator()
    if symmetric is None:
        return torch.cuda.MemPool(allocator)
    params = inspect.signature(torch.cuda.MemPool).parameters
    for name in ("symmetric", "symm_mem"):
        if name in params:
            return torch.cuda.MemPool(allocator, **{name: symmetric})
    raise ValueError("symmetric setting with torch.cuda.MemPool requires a newer PyTorch")


def init() -> None:
    """Set the environment NCCL reads for NVLS with registered buffers (as Apex): ``NCCL_NVLS_ENABLE=1`` and
    ``TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=0``. Call before creating the process group."""
    os.environ["NCCL_NVLS_ENABLE"] = "1"
    os.environ["TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"] = "0"


def _cuda_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, bool) or not isinstance(device, (int, str, torch.device)):
        raise TypeError(f"device must be None, an int, a str or a torch.device, got {type(device).__name__}")
    if isinstance(device, int):
        return torch.device("cuda", device)
    device = torch.device(device)
    if device.type != "cuda":  # Apex asserts this
        raise AssertValueError(f"device must be a CUDA device, got {device}")
    return device


class nccl_mem:
    """Context manager: CUDA allocations inside come from ``pool`` (see :func:`create_nccl_mem_pool`).

    ``enabled=False`` makes it a no-op (Apex's switch). On exit the pool's memory is registered with the
    process group's NCCL backend (``group`` or the default group), so collectives on tensors allocated
    inside can use the registered buffers. Where ``pool`` is ``None`` (no CUDA) it is a no-op and
    allocations proceed normally.
    """

    def __init__(self, pool, enabled: bool = True, device=None, group=None) -> None:
        self.device = None
        self.group = None
        self.pool = pool
        self.mem_context = nullcontext()
        if not enabled or pool is None:
            return
        if not _cuda():
            raise RuntimeError("nccl_mem was given a memory pool but CUDA is not available")
        self.device = _cuda_device(device)
        self.group = _nccl_group(group)
        self.mem_context = torch.cuda.use_mem_pool(pool, self.device)

    def _backend(self):
        try:
            return self.group._get_backend(self.device)
        except RuntimeError:
            return None

    def __enter__(self) -> nccl_mem:
        self.mem_context.__enter__()
        if self.group is not None and (backend := self._backend()) is not None:
            # Allocations are about to change the pool: drop its registration (re-registered on exit).
            try:
                backend.deregister_mem_pool(self.pool)
            except (RuntimeError, AttributeError):
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self.group is not None and (backend := self._backend()) is not None:
            try:
                backend.register_mem_pool(self.pool)
            except (RuntimeError, AttributeError):
                pass
        self.mem_context.__exit__(*exc)
