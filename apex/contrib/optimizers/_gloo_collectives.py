"""Reduce-scatter and all-gather for the ZeRO optimizers on Gloo, from Gloo's faster primitives.

Gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` take longer than the data they move needs.
Measured on 2 ranks of a 2-core machine, 4 MB of fp32: ``reduce_scatter_tensor`` 4.6 ms, ``all_reduce``
2.8 ms, ``all_to_all_single`` of the same buffer 1.2 ms; ``all_gather_into_tensor`` 2.3 ms, one batch of
point-to-point transfers 1.1 ms. So here:

* reduce-scatter = one ``all_to_all_single`` that brings every peer's copy of this rank's chunk (Gloo runs
  it on its worker thread, so posting it from a backward hook never blocks) and the sum of the copies and
  the local chunk in rank order, divided by the world size for an average (which Gloo's collectives lack);
* all-gather = every rank sends its shard to every peer and receives each peer's shard straight into its
  place in the output (``batch_isend_irecv``; on two ranks one ``all_to_all_single`` does that exchange).

Each moves ``(world - 1) / world`` of the buffer out of and into every rank, the minimum for both.
``reduce_scatter_tensor`` / ``all_gather_into_tensor`` take ``torch.distributed``'s arguments and choose:
the above on a Gloo group, the backend's own collective elsewhere (NCCL). Every rank of ``group`` must call
them in the same order, as for any collective: transfers between a pair of ranks match in posting order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_dist_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Point-to-point tag of these transfers, so they never match a caller's own send/recv on the same group.
_TAG = 0x5A45  # "ZE"
# Tensors up to this many elements are all-reduced by gathering them (see all_reduce).
_SMALL = 1 << 16
_LOCAL_REDUCE = {dist.ReduceOp.SUM: lambda rows: rows.sum(0), dist.ReduceOp.MIN: lambda rows: rows.amin(0),
                 dist.ReduceOp.MAX: lambda rows: rows.amax(0)}


class PendingCollective:
    """An asynchronous collective: ``wait()`` waits for its transfers, then finishes the local part."""

    def __init__(self, works: list, finish: Callable[[], None] | None = None) -> None:
        self._works = works
        self._finish = finish

    def wait(self) -> bool:
        for w in self._works:
            w.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()
        return True

    def is_completed(self) -> bool:
        return self._finish is None and not self._works


def _peers(group) -> tuple[int, int, list[int]]:
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    global_ranks = [dist.get_global_rank(group, r) if group is not None and group is not dist.group.WORLD
                    else r for r in range(world)]
    return world, rank, global_ranks


def _check(name: str, big: torch.Tensor, small: torch.Tensor, world: int) -> None:
    if not (big.is_contiguous() and small.is_contiguous()):
        raise ValueError(f"{name} needs contiguous tensors")
    if big.dtype != small.dtype or big.numel() != small.numel() * world:
        raise ValueError(f"{name}: the large tensor must hold world_size ({world}) times the "
                         f"{small.numel()} elements of the small one in its dtype {small.dtype}, "
                         f"got {big.numel()} {big.dtype}")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *, average: bool = False,
                   scratch: torch.Tensor | None = None) -> PendingCollective:
    """``output = sum over ranks r of input_r[rank * n:(rank + 1) * n]`` with ``n = output.numel()``, divided
    by the world size when ``average``.

    The sum runs in rank order (the same order whichever rank owns the chunk), in ``input``'s dtype.
    ``input`` must stay unchanged until ``wait()`` returns, except that ``output`` may be this rank's own chunk
    of it (in place); ``scratch`` (``input``'s size and dtype) receives
    the peers' chunks (a fresh buffer when not given).
    """
    world, rank, ranks = _peers(group)
    _check("reduce_scatter", input, output, world)
    chunks = input.view(world, -1)
    if world == 1:
        output.copy_(chunks[0])
        return PendingCollective([])
    # One all-to-all (Gloo runs it on its worker thread, so posting never blocks the caller) brings every
    # peer's copy of this rank's chunk. The first and last ranks' own chunk lies at an end of ``input``, so
    # it is left out of the exchange rather than copied to itself (measured: 1.3 vs 1.8 ms for 4 MB on 2
    # ranks, sum included); a middle rank's own chunk cannot be cut out of the one input tensor.
    if scratch is None:
        scratch = torch.empty_like(input)
    _check("reduce_scatter", scratch, output, world)
    n = output.numel()
    if rank in (0, world - 1):
        send = input[n:] if rank == 0 else input[:-n]
        splits = [0 if r == rank else n for r in range(world)]
    else:
        send, splits = input, [n] * world
    received = scratch[:sum(splits)]
    works = [dist.all_to_all_single(received, send, splits, splits, group=group, async_op=True)]

    def finish() -> None:
        parts, offset = [], 0
        for r in range(world):  # the contributions in rank order, the same order on every rank
            parts.append(chunks[r] if r == rank else received[offset:offset + n])
            offset += splits[r]
        if rank >= 2 and output.data_ptr() == chunks[rank].data_ptr():
            # In place on a rank whose own chunk is added after the first two: keep it from being overwritten.
            parts[rank] = parts[rank].clone()
        if average and world == 2 and output.dtype == torch.float32:
            # (a + b) / 2 in one pass instead of two; within an ulp of it, and no overflow in fp32's range
            torch.lerp(parts[0], parts[1], 0.5, out=output)
            return
        torch.add(parts[0], parts[1], out=output)
        for part in parts[2:]:
            output.add_(part)
        if average:
            output.div_(world)

    return PendingCollective(works, finish)


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> PendingCollective:
    """``output[r * n:(r + 1) * n] = input_r`` for every rank ``r`` of ``group``, ``n = input.numel()``."""
    world, rank, ranks = _peers(group)
    _check("all_gather", output, input, world)
    chunks = output.view(world, -1)
    if chunks[rank].data_ptr() != input.data_ptr():
        chunks[rank].copy_(input)
    if world == 2:
        # Two ranks: one all-to-all that sends the shard and receives the peer's, run on Gloo's worker
        # thread; point-to-point sends write into the socket from the calling thread and took 1.3-4.8 ms
        # against 0.9-1.3 ms for this, 2 MB each way.
        splits = [0, input.numel()] if rank == 0 else [input.numel(), 0]
        return PendingCollective([dist.all_to_all_single(chunks[1 - rank], input, splits, splits, group=group,
                                                         async_op=True)])
    ops = []
    for step in range(1, world):
        dst, src = (rank + step) % world, (rank - step) % world
        ops.append(dist.P2POp(dist.isend, input, ranks[dst], group, _TAG))
        ops.append(dist.P2POp(dist.irecv, chunks[src], ranks[src], group, _TAG))
    return PendingCollective(dist.batch_isend_irecv(ops) if ops else [])


def takes_gloo_path(group=None, op=dist.ReduceOp.SUM) -> bool:
    """Whether ``reduce_scatter_tensor`` with ``op`` (and ``all_gather_into_tensor``) on ``group`` run the
    transfers above (and so use a reduce-scatter's ``scratch``) rather than the backend's own collective."""
    return op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and dist.get_backend(group) == "gloo"


def _finished(work: PendingCollective, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=dist.ReduceOp.SUM, group=None,
                          async_op: bool = False, *, scratch: torch.Tensor | None = None):
    """``torch.distributed.reduce_scatter_tensor``; on a Gloo group a sum or an average (which Gloo lacks)
    runs as ``reduce_scatter`` (with ``scratch``, unused elsewhere)."""
    if not takes_gloo_path(group, op):
        return _dist_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    return _finished(reduce_scatter(output, input, group, average=op == dist.ReduceOp.AVG, scratch=scratch),
                     async_op)


def all_gather_into_tensor(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``torch.distributed.all_gather_into_tensor``; on a Gloo group it runs as ``all_gather``."""
    if not takes_gloo_path(group):
        return _dist_all_gather(output, input, group=group, async_op=async_op)
    return _finished(all_gather(output, input, group), async_op)


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, group=None) -> None:
    """``torch.distributed.all_reduce`` (synchronous). On a Gloo group a small tensor (norms, flags) is
    gathered from every rank in one ``all_gather_into_tensor`` and reduced locally, the same way on every
    rank, so all ranks get the same bits: one exchange where Gloo's all-reduce takes several, each
    a wake-up of both ranks (measured for 98 fp32 on 2 ranks: 0.23-0.44 ms against 0.34-1.18 ms)."""
    if (op not in _LOCAL_REDUCE or tensor.numel() > _SMALL or not tensor.is_contiguous()
            or dist.get_backend(group) != "gloo"):
        dist.all_reduce(tensor, op=op, group=group)
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    rows = torch.empty([world * tensor.numel()], dtype=tensor.dtype, device=tensor.device)
    _dist_all_gather(rows, tensor.reshape(-1), group=group)
    tensor.copy_(_LOCAL_REDUCE[op](rows.view(world, -1)).view(tensor.shape))


# ---------------------------------------------------------------------------------- Apex's coalescing names
class _GatheredWork:
    """What ``_coalescing_manager`` yields where the backend cannot coalesce (Gloo): the asynchronous works
    appended to it (``_coalescing_manager_append_work``), waited for together."""

    def __init__(self) -> None:
        self.works: list = []

    def append(self, work) -> None:
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()


def _can_coalesce(group) -> bool:
    # torch.distributed's coalescing manager needs the backend's start/endCoalescing: NCCL has them, Gloo not.
    try:
        return dist.get_backend(group) not in ("gloo", "mpi")
    except (RuntimeError, ValueError):
        return False


def _coalescing_manager(group=None, device=None, async_ops: bool = False):
    """Apex's ``_coalescing_manager(group, device, async_ops)`` (a context manager whose value has
    ``wait()``): ``torch.distributed``'s, which sends the collectives issued inside as one, where the
    backend coalesces (NCCL); elsewhere (Gloo) the collectives run as issued and ``wait()`` waits for the
    works handed to ``_coalescing_manager_append_work``. With ``async_ops=False`` the block's end waits."""
    if _can_coalesce(group):
        from torch.distributed.distributed_c10d import _coalescing_manager as torch_manager

        return torch_manager(group, device, async_ops=async_ops)
    return _gathered(async_ops)


class _gathered:  # noqa: N801 - a context manager used as a function, like contextlib's
    def __init__(self, async_ops: bool) -> None:
        self.async_ops, self.cm = async_ops, _GatheredWork()

    def __enter__(self) -> _GatheredWork:
        return self.cm

    def __exit__(self, *exc) -> None:
        if not self.async_ops and exc[0] is None:
            self.cm.wait()


def _coalescing_manager_append_work(cm, work) -> None:
    """Apex's: hand an asynchronous collective's work to a coalescing manager. PyTorch's manager tracks its
    works itself (Apex's function does nothing there); the Gloo fallback waits for them in ``wait()``."""
    if isinstance(cm, _GatheredWork):
        cm.append(work)


def _devices_match(device1, device2) -> bool:
    """Whether two devices are the same one (Apex's): same type and, for CUDA, the same index, an index
    left out meaning the current device."""
    device1, device2 = torch.device(device1), torch.device(device2)
    if device1.type != device2.type:
        return False
    if device1.type == "cuda":
        current = torch.cuda.current_device
        return (device1.index if device1.index is not None else current()) == \
            (device2.index if device2.index is not None else current())
    return True
