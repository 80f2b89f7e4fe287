"""Compatibility module for code that does ``import nccl_p2p_cuda`` (Apex's compiled extension).

Names are resolved on first access from ``apex.contrib.peer_memory._nccl_p2p_cuda`` (the halo exchange on the
default torch.distributed process group, any backend).
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.contrib.peer_memory._nccl_p2p_cuda"

# name -> module holding it
_OPS: dict[str, str] = {name: _M for name in (
    "get_unique_nccl_id", "init_nccl_comm", "left_right_halo_exchange_inplace", "left_right_halo_exchange",
    "add_delay")}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
