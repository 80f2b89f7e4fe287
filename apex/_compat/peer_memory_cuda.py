"""Compatibility module for code that does ``import peer_memory_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.contrib.peer_memory._peer_memory_cuda`` (raw buffers by address
and ``push_pull_halos_1d`` on torch.distributed send/recv; no CUDA IPC: see that module).
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.contrib.peer_memory._peer_memory_cuda"

# name -> module holding it
_OPS: dict[str, str] = {name: _M for name in (
    "allocate_raw", "free_raw", "zero", "get_raw_ipc_address", "get_raw_peers", "blob_view_half",
    "blob_view_float", "blob_view_int", "push_pull_halos_1d")}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
