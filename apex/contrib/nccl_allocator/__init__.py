"""Apex's ``apex.contrib.nccl_allocator``: tensors allocated from NCCL-registered memory, for faster NVLS
collectives. See :mod:`apex.contrib.nccl_allocator.nccl_allocator`."""

from apex.contrib.nccl_allocator.nccl_allocator import create_nccl_mem_pool, init, nccl_mem

__all__ = ["init", "nccl_mem", "create_nccl_mem_pool"]
