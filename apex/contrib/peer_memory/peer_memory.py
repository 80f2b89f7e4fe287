"""Apex's ``PeerMemoryPool`` without CUDA IPC: the pool's bookkeeping (static and dynamic regions, 256-byte
alignment, ``reset``) over one buffer of this rank's own memory.

Apex's pool maps every peer GPU's pool into this process so kernels can write straight into a neighbour's
memory. PyTorch offers no portable peer mapping (and none at all on CPUs), so here the halo exchangers move
data with ``torch.distributed`` send/recv and the pool only hands out staging regions:
``allocate_peer_tensors`` returns, for each peer rank, a view of *this rank's* buffer at the region's offset
(the same region for every peer). Writing into entry ``i`` does not reach rank ``peer_ranks[i]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from apex._errors import AssertRuntimeError, AssertTypeError, AssertValueError

_ALIGNMENT = 256
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.int32)


def _round_up(n: int) -> int:
    return (n + _ALIGNMENT - 1) // _ALIGNMENT * _ALIGNMENT


def _default_peer_ranks(rank: int, world: int) -> list[int]:
    # Apex's default peer group: the ranks sharing this node's GPUs (device_count consecutive ranks). Without
    # GPUs every rank of the world is a peer: there is no node-local memory to share anyway.
    n = world
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        n = min(torch.cuda.device_count(), world)
    base = rank // n * n
    return list(range(base, base + n))


class PeerMemoryPool:
    """Regions of ``static_size`` + ``dynamic_size`` bytes (each rounded up to 256) for the halo exchangers.

    Args:
        static_size: bytes of the static region (regions allocated once, kept for the pool's life).
        dynamic_size: bytes of the dynamic region (rewound by :meth:`reset`, e.g. once per step).
        peer_ranks: the global ranks this pool is shared with; default as Apex: the ranks of this node (all
            ranks when there are no GPUs).
        device: where the buffer lives (keyword only; default the current CUDA device if CUDA is available,
            else the CPU). The buffer is allocated on first use.

    Needs an initialised default process group, as Apex's pool does.
    """

    def __init__(self, static_size: int, dynamic_size: int, peer_ranks: Sequence[int] | None = None, *,
                 device: torch.device | str | None = None) -> None:
        for name, v in (("static_size", static_size), ("dynamic_size", dynamic_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"PeerMemoryPool: {name} must be a non-negative int of bytes, got {v!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("PeerMemoryPool needs torch.distributed.init_process_group first")
        rank, world = dist.get_rank(), dist.get_world_size()
        if peer_ranks is None:
            peer_ranks = _default_peer_ranks(rank, world)
        peer_ranks = list(peer_ranks)
        bad = [r for r in peer_ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world]
        if bad or not peer_ranks:  # Apex asserts the peers are on this node
            raise AssertValueError(f"PeerMemoryPool: peer_ranks must be a non-empty list of ranks in [0, {world}), "
                             f"got {peer_ranks!r}")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.alignment = _ALIGNMENT
        self.static_size = _round_up(static_size)
        self.dynamic_size = _round_up(dynamic_size)
        self.static_offset = 0
        self.dynamic_offset = 0
        self.peer_ranks = peer_ranks
        self._raw: torch.Tensor | None = None

    def reset(self) -> None:
        """Rewind the dynamic region: every dynamic allocation made so far may be handed out again."""
        self.dynamic_offset = 0

    def _buffer(self) -> torch.Tensor:
        if self._raw is None:
            self._raw = torch.zeros(self.static_size + self.dynamic_size, dtype=torch.uint8, device=self.device)
        return self._raw

    def allocate_peer_tensors(self, shape: Sequence[int], dtype: torch.dtype, channels_last: bool,
                              dynamic: bool) -> list[torch.Tensor]:
        """One tensor of ``shape`` and ``dtype`` per peer rank, from the dynamic or the static region.

        ``channels_last`` gives 4-d views channels_last strides. Every entry is a view of this rank's own
        buffer (see the module docstring). Errors, each also the ``AssertionError`` Apex raised: an unsupported
        dtype (``TypeError``; Apex supports float16, float32 and int32, bfloat16 is accepted too) or an exhausted
        region (``RuntimeError``, nothing allocated).
        """
        if dtype not in _DTYPES:
            raise AssertTypeError(f"allocate_peer_tensors: dtype must be one of {_DTYPES}, got {dtype}")
        shape = [int(s) for s in shape]
        if any(s < 0 for s in shape):
            raise ValueError(f"allocate_peer_tensors: shape must be non-negative, got {shape}")
        if channels_last and len(shape) != 4:
            raise ValueError(f"allocate_peer_tensors: channels_last needs a 4-d shape, got {shape}")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        offset = self.dynamic_offset if dynamic else self.static_offset
        size = self.dynamic_size if dynamic else self.static_size
        start = _round_up(offset)
        if start + nbytes > size:
            region = "dynamic" if dynamic else "static"
            raise AssertRuntimeError(f"{region} peer memory pool exhausted: {nbytes} bytes requested at offset {start} "
                               f"of a {size}-byte region")
        if dynamic:
            self.dynamic_offset = start + nbytes
            start += self.static_size
        else:
            self.static_offset = start + nbytes
        flat = self._buffer()[start:start + nbytes].view(dtype)
        if channels_last:
            n, c, h, w = shape
            view = flat.as_strided(shape, (h * w * c, 1, w * c, c))
        else:
            view = flat.view(shape)
        return [view for _ in self.peer_ranks]
