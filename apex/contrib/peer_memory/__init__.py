"""Apex's ``apex.contrib.peer_memory``: ``PeerMemoryPool`` and ``PeerHaloExchanger1d``, halo exchange between
neighbouring ranks of a spatially split activation, on ``torch.distributed`` send/recv (no CUDA IPC)."""

from apex.contrib.peer_memory.peer_halo_exchanger_1d import PeerHaloExchanger1d
from apex.contrib.peer_memory.peer_memory import PeerMemoryPool

__all__ = ["PeerHaloExchanger1d", "PeerMemoryPool"]
