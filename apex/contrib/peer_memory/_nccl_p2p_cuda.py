"""The functions of Apex's ``nccl_p2p_cuda`` extension, with its positional signatures, on ``torch.distributed``.

Apex creates a second NCCL communicator from a broadcast ``ncclUniqueId`` and returns an int handle to it.
Here a "communicator" is the default ``torch.distributed`` process group (whatever its backend): the unique id
is only an opaque token, ``init_nccl_comm`` checks that ``my_rank``/``num_ranks`` are this process's place in
the default group and returns a handle; ranks passed to the exchange are global ranks of that group, and a
negative rank means "no neighbour on that side" (that input halo is zeroed), as in Apex. The handle table is
process-wide, like Apex's.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from apex.contrib.peer_memory._halo import exchange_halos

_UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)


class _Communicators:
    """Handle -> process group, the table behind Apex's int communicator handles."""

    def __init__(self) -> None:
        self._groups: list = []

    def add(self, group) -> int:
        self._groups.append(group)
        return len(self._groups) - 1

    def get(self, handle: int):
        if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < len(self._groups):
            raise ValueError(f"handle must come from init_nccl_comm (0..{len(self._groups) - 1}), got {handle!r}")
        return self._groups[handle]


_COMMS = _Communicators()


def get_unique_nccl_id(n: int) -> torch.Tensor:
    """``n`` opaque ids, a (n, 128) uint8 CPU tensor (random bytes; only ``init_nccl_comm``'s argument)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"get_unique_nccl_id: n must be a positive int, got {n!r}")
    return torch.frombuffer(bytearray(os.urandom(n * _UNIQUE_ID_BYTES)), dtype=torch.uint8).reshape(
        n, _UNIQUE_ID_BYTES)


def init_nccl_comm(unique_nccl_id: torch.Tensor, my_rank: int, num_ranks: int) -> int:
    """A handle to the default process group, after checking this process is ``my_rank`` of ``num_ranks``."""
    if not isinstance(unique_nccl_id, torch.Tensor) or unique_nccl_id.dtype != torch.uint8:
        raise TypeError("init_nccl_comm: unique_nccl_id must be the uint8 tensor of get_unique_nccl_id")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("init_nccl_comm needs torch.distributed.init_process_group first: its communicator is "
                           "the default process group")
    rank, world = dist.get_rank(), dist.get_world_size()
    if my_rank != rank or num_ranks != world:
        raise ValueError(f"init_nccl_comm: my_rank={my_rank!r}, num_ranks={num_ranks!r}, but this process is rank "
                         f"{rank} of {world} in the default process group (the only communicator available here)")
    return _COMMS.add(None)


def left_right_halo_exchange_inplace(handle: int, left_rank: int, right_rank: int, left_output_halo: torch.Tensor,
                                     right_output_halo: torch.Tensor, left_input_halo: torch.Tensor,
                                     right_input_halo: torch.Tensor) -> None:
    """Send ``left_output_halo`` to ``left_rank`` and ``right_output_halo`` to ``right_rank``; receive their
    halos into ``left_input_halo`` / ``right_input_halo``. A negative rank zeroes that input halo."""
    group = _COMMS.get(handle)
    exchange_halos(left_output_halo, right_output_halo, left_input_halo, right_input_halo,
                   None if left_rank < 0 else left_rank, None if right_rank < 0 else right_rank, group)


def left_right_halo_exchange(handle: int, left_rank: int, right_rank: int, left_output_halo: torch.Tensor,
                             right_output_halo: torch.Tensor) -> list[torch.Tensor]:
    """As :func:`left_right_halo_exchange_inplace` into new tensors; returns ``[left_input_halo,
    right_input_halo]``."""
    right_input_halo = torch.empty_like(left_output_halo)
    left_input_halo = torch.empty_like(right_output_halo)
    left_right_halo_exchange_inplace(handle, left_rank, right_rank, left_output_halo, right_output_halo,
                                     left_input_halo, right_input_halo)
    return [left_input_halo, right_input_halo]


def add_delay(delay: int) -> None:
    """Apex spins a one-thread kernel for ``delay`` nanoseconds on the current stream (to test overlap). Here
    the host waits ``delay`` ns after the current CUDA stream's work (if any): the work after it starts at least
    that much later."""
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ValueError(f"add_delay: delay must be a non-negative int of nanoseconds, got {delay!r}")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    time.sleep(delay * 1e-9)
