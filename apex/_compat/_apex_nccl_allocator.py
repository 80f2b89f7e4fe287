"""Compatibility module for ``import _apex_nccl_allocator`` (Apex's compiled ncclMemAlloc allocator).

``get_nccl_allocator()`` returns PyTorch's own ``ncclMemAlloc`` allocator of the default NCCL process
group, or ``None`` (PyTorch's default CUDA allocator) where there is none; see
``apex.contrib.nccl_allocator``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "get_nccl_allocator": "apex.contrib.nccl_allocator.nccl_allocator",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
