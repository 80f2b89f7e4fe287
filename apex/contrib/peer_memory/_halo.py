"""The one halo-exchange primitive every exchanger here is built on: point-to-point send/recv with the left and
right neighbour through ``torch.distributed`` (``batch_isend_irecv``), whatever the process group's backend
(NCCL for CUDA tensors, Gloo for CPU tensors, ...).

A rank sends ``left_send`` to its left neighbour, which receives it into its ``right_recv``, and ``right_send``
to its right neighbour, which receives it into its ``left_recv``. A side without a neighbour (``None``) sends
nothing and its receive buffer is zeroed, as Apex's exchangers do at the edges of the spatial group. The
receive buffers may be non-contiguous views (a halo row of an NCHW tensor): the data travel through contiguous
staging tensors. A neighbour that never answers makes the wait fail with the process group's timeout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# Tags keep the two directions apart when the left and right neighbour are the same rank (Gloo honours tags;
# NCCL matches sends and receives in order, which gives the same pairing).
_TAG_TO_LEFT = 7101
_TAG_TO_RIGHT = 7102


def _check_halos(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> None:
    first = tensors[0]
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"halo buffers must share shape, dtype and device: {names[0]} is {tuple(first.shape)} "
                f"{first.dtype} on {first.device}, {name} is {tuple(t.shape)} {t.dtype} on {t.device}")


def exchange_halos(left_send: torch.Tensor, right_send: torch.Tensor, left_recv: torch.Tensor,
                   right_recv: torch.Tensor, left_peer: int | None, right_peer: int | None,
                   group=None) -> None:
    """Send ``left_send``/``right_send`` to the global ranks ``left_peer``/``right_peer`` and receive theirs
    into ``left_recv``/``right_recv`` (in place); a ``None`` peer zeroes that receive buffer.

    All four buffers have one shape, dtype and device (the receive buffers may alias the caller's tensor,
    e.g. the padding rows of a halo-padded activation). Bit-exact: data are copied, never converted.
    """
    _check_halos(("left_send", "right_send", "left_recv", "right_recv"),
                 (left_send, right_send, left_recv, right_recv))
    ops, landing = [], []
    for peer, send, recv, send_tag, recv_tag in ((left_peer, left_send, left_recv, _TAG_TO_LEFT, _TAG_TO_RIGHT),
                                                 (right_peer, right_send, right_recv, _TAG_TO_RIGHT, _TAG_TO_LEFT)):
        if peer is None:
            continue
        # send/recv need contiguous tensors; staging also snapshots the outgoing rows before anything lands
        staged_send = send.detach().clone(memory_format=torch.contiguous_format)
        staged_recv = torch.empty(recv.shape, dtype=recv.dtype, device=recv.device)
        ops.append(dist.P2POp(dist.isend, staged_send, peer, group, send_tag))
        ops.append(dist.P2POp(dist.irecv, staged_recv, peer, group, recv_tag))
        landing.append((recv, staged_recv))
    if ops:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("halo exchange with a neighbour needs torch.distributed.init_process_group first")
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    # zero the edges only after the sends are staged: a receive buffer may alias an outgoing halo
    if left_peer is None:
        left_recv.zero_()
    if right_peer is None:
        right_recv.zero_()
    for recv, staged in landing:
        recv.copy_(staged)


def check_group_position(what: str, ranks, rank_in_group) -> list[int]:
    """``ranks`` as a list after checking it is non-empty and ``rank_in_group`` indexes it."""
    ranks = list(ranks)
    if not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in ranks):
        raise ValueError(f"{what}: ranks must be a non-empty list of global ranks, got {ranks!r}")
    if isinstance(rank_in_group, bool) or not isinstance(rank_in_group, int) or not 0 <= rank_in_group < len(ranks):
        raise ValueError(f"{what}: rank_in_group must be in [0, {len(ranks)}), got {rank_in_group!r}")
    return ranks
