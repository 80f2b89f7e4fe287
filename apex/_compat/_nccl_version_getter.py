"""Compatibility module for ``import _nccl_version_getter`` (Apex's build-time NCCL version probe).

``get_nccl_version()`` returns ``(major, minor)`` from ``torch.cuda.nccl.version()``, and raises
RuntimeError on PyTorch builds without NCCL.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "get_nccl_version": "apex.contrib.nccl_allocator.nccl_allocator",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
