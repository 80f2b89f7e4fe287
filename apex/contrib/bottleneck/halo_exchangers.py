"""Apex's halo exchangers for ``SpatialBottleneck``, on ``torch.distributed`` (any backend) instead of Apex's
private NCCL communicator and CUDA IPC peer memory.

Every exchanger has ``left_right_halo_exchange(left_output_halo, right_output_halo, left_input_halo=None,
right_input_halo=None)``: this rank's ``left_output_halo`` (its first rows) goes to the left neighbour, whose
``right_input_halo`` receives it; ``right_output_halo`` (its last rows) goes to the right neighbour's
``left_input_halo``. The first rank of the group gets a zero left input halo, the last rank a zero right one.
With input halos given the exchange is in place and returns None; without, it returns the new
``(left_input_halo, right_input_halo)``. All halos of one call share shape, dtype and device (any layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from apex._errors import AssertValueError
from apex.contrib.peer_memory import PeerMemoryPool
from apex.contrib.peer_memory._halo import check_group_position, exchange_halos


class HaloExchanger:
    """Neighbour bookkeeping shared by the exchangers: ``ranks`` (global ranks of the spatial group, in split
    order) and this rank's index ``rank_in_group`` in it."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int) -> None:
        ranks = check_group_position(type(self).__name__, ranks, rank_in_group)
        self.group_size = len(ranks)
        self.ranks = ranks
        self.rank_in_group = rank_in_group
        self.wrap_around_left_rank_in_group = (rank_in_group + self.group_size - 1) % self.group_size
        self.wrap_around_right_rank_in_group = (rank_in_group + 1) % self.group_size
        self.left_rank = ranks[rank_in_group - 1] if rank_in_group > 0 else -1
        self.left_zero = rank_in_group == 0
        self.right_rank = ranks[rank_in_group + 1] if rank_in_group < self.group_size - 1 else -1
        self.right_zero = rank_in_group == self.group_size - 1

    @staticmethod
    def _outputs(left_output_halo, right_output_halo, left_input_halo, right_input_halo):
        if (left_input_halo is None) != (right_input_halo is None):
            raise ValueError("left_input_halo and right_input_halo must both be given (in place) or both be None")
        if left_input_halo is None:
            return torch.empty_like(right_output_halo), torch.empty_like(left_output_halo), False
        return left_input_halo, right_input_halo, True


class HaloExchangerNoComm(HaloExchanger):
    """No communication, for performance tests only (as Apex): the input halos are this rank's own output halos
    swapped (left input <- right output, right input <- left output). Not a correct halo exchange."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int) -> None:
        super().__init__(ranks, rank_in_group)

    def left_right_halo_exchange(self, left_output_halo, right_output_halo, left_input_halo=None,
                                 right_input_halo=None):
        if left_input_halo is None:
            return right_output_halo, left_output_halo
        left_input_halo.copy_(right_output_halo)
        right_input_halo.copy_(left_output_halo)


class HaloExchangerAllGather(HaloExchanger):
    """Exchange through one ``all_gather`` of every rank's two output halos over ``comm``.

    ``comm`` is the process group holding exactly ``ranks`` (as Apex, e.g. ``torch.distributed.new_group(ranks)``)
    or None for the default group (then every rank of the world takes part and ``ranks`` index into it).
    """

    def __init__(self, ranks: Sequence[int], rank_in_group: int, comm) -> None:
        super().__init__(ranks, rank_in_group)
        self.comm = comm

    def left_right_halo_exchange(self, left_output_halo, right_output_halo, left_input_halo=None,
                                 right_input_halo=None):
        left_in, right_in, inplace = self._outputs(left_output_halo, right_output_halo, left_input_halo,
                                                   right_input_halo)
        if left_output_halo.shape != right_output_halo.shape:
            raise ValueError(f"left_output_halo {tuple(left_output_halo.shape)} and right_output_halo "
                             f"{tuple(right_output_halo.shape)} must have one shape")
        send = torch.stack((left_output_halo.detach(), right_output_halo.detach()))
        n = dist.get_world_size(self.comm)
        gathered = [torch.empty_like(send) for _ in range(n)]
        dist.all_gather(gathered, send, group=self.comm)
        # all_gather's list is in the group's rank order (sorted global ranks), not necessarily ``ranks``' order
        left_src, right_src = (self.ranks[i] if self.comm is None else dist.get_group_rank(self.comm, self.ranks[i])
                               for i in (self.wrap_around_left_rank_in_group, self.wrap_around_right_rank_in_group))
        with torch.no_grad():
            if self.left_zero:
                left_in.zero_()
            else:
                left_in.copy_(gathered[left_src][1])
            if self.right_zero:
                right_in.zero_()
            else:
                right_in.copy_(gathered[right_src][0])
        return None if inplace else (left_in, right_in)


class _PointToPoint(HaloExchanger):
    """Send/recv to the two neighbours in ``self.group`` (None: the default group)."""

    group = None

    def left_right_halo_exchange(self, left_output_halo, right_output_halo, left_input_halo=None,
                                 right_input_halo=None):
        left_in, right_in, inplace = self._outputs(left_output_halo, right_output_halo, left_input_halo,
                                                   right_input_halo)
        with torch.no_grad():
            exchange_halos(left_output_halo, right_output_halo, left_in, right_in,
                           None if self.left_zero else self.left_rank,
                           None if self.right_zero else self.right_rank, self.group)
        return None if inplace else (left_in, right_in)


class HaloExchangerSendRecv(_PointToPoint):
    """Exchange with point-to-point send/recv to the two neighbours (Apex: its own NCCL communicator; here the
    default ``torch.distributed`` group, or ``group`` given as a keyword). ``ranks[rank_in_group]`` must be this
    process's global rank."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int, *, group=None) -> None:
        super().__init__(ranks, rank_in_group)
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("HaloExchangerSendRecv needs torch.distributed.init_process_group first")
        me = dist.get_rank()
        if self.ranks[rank_in_group] != me:
            raise AssertValueError(f"HaloExchangerSendRecv: ranks[{rank_in_group}] is {self.ranks[rank_in_group]}, "
                             f"but this process is global rank {me}")
        self.group = group


class HaloExchangerPeer(_PointToPoint):
    """Apex's peer-memory exchanger; here the same send/recv exchange as :class:`HaloExchangerSendRecv` (there is
    no CUDA IPC). ``peer_pool`` is kept for Apex's callers; ``explicit_nhwc`` and ``numSM`` tuned Apex's kernel
    (the exchange works on halos of any layout) and are accepted."""

    def __init__(self, ranks: Sequence[int], rank_in_group: int, peer_pool: PeerMemoryPool | None,
                 explicit_nhwc: bool, numSM: int = 0, *, group=None) -> None:
        super().__init__(ranks, rank_in_group)
        self.diagnostics = False
        self.explicit_nhwc = explicit_nhwc
        self.numSM = numSM
        self.peer_pool = peer_pool
        self.group = group


class HaloPadder:
    """Apex's ``HaloPadder``: ``y`` padded with ``half_halo`` rows from the neighbours on both ends of the split
    dimension (H when ``H_split``, else W). ``wait()`` is a no-op: the exchange is complete on return."""

    def __init__(self, halo_ex: HaloExchanger) -> None:
        self.halo_ex = halo_ex

    def __call__(self, y: torch.Tensor, half_halo: int, explicit_nhwc: bool, H_split: bool) -> torch.Tensor:
        dim = (1 if H_split else 2) if explicit_nhwc else (2 if H_split else 3)
        n = y.shape[dim]
        if not 1 <= half_halo <= n:
            raise ValueError(f"HaloPadder: half_halo must be in [1, {n}], got {half_halo!r}")
        shape = list(y.shape)
        shape[dim] = n + 2 * half_halo
        fmt = torch.channels_last if not explicit_nhwc and y.is_contiguous(memory_format=torch.channels_last) \
            else torch.contiguous_format
        ypad = torch.empty(shape, dtype=y.dtype, device=y.device, memory_format=fmt)
        ypad.narrow(dim, half_halo, n).copy_(y)
        self.halo_ex.left_right_halo_exchange(
            y.narrow(dim, 0, half_halo), y.narrow(dim, n - half_halo, half_halo),
            ypad.narrow(dim, 0, half_halo), ypad.narrow(dim, n + half_halo, half_halo))
        return ypad

    def wait(self) -> None:
        pass
