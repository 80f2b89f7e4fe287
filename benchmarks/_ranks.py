"""Multi-rank benchmark cases on Gloo ranks of this machine.

The benchmark process is rank 0 and spawns the others. Every rank builds the case's steps object
(``make(rank, cfg)``, a picklable callable: a module-level class or function); rank 0 broadcasts which step
runs next (``Ranks.step``), so every rank issues the same collectives, and both timed sides pay that same
small broadcast. The steps object's ``run(which)`` does that rank's part of a step (it may do nothing on
some ranks, e.g. a one-process reference timed on rank 0 only); an optional ``close()`` tears down what it
set up. The ranks stop when the harness drops the callables ``Ranks.timed`` returned.
"""

from __future__ import annotations

import datetime
import gc
import os
import socket
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STOP = 0  # the command that ends the followers' loop; cases number their steps from 1
_TIMEOUT = datetime.timedelta(seconds=120)


def _init(rank: int, world: int, port: int, threads: int) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=_TIMEOUT)


def _close(steps) -> None:
    close = getattr(steps, "close", None)
    if close is not None:
        close()


def _finish() -> None:
    """End the process group once the steps object is dropped. Its models, optimizers and DDP hold the group
    and finished works; left to interpreter exit, Gloo's threads can be torn down after the C++ runtime (an
    intermittent SIGABRT in the spawned rank)."""
    gc.collect()
    dist.destroy_process_group()


def _serve(steps) -> None:
    cmd = torch.zeros(1, dtype=torch.int64)
    while True:
        dist.broadcast(cmd, 0)
        which = int(cmd.item())
        if which == STOP:
            break
        steps.run(which)
    _close(steps)


def _follower(index: int, world: int, port: int, threads: int, make: Callable, cfg) -> None:
    rank = index + 1  # mp.start_processes numbers the followers from 0
    _init(rank, world, port, threads)
    _serve(make(rank, cfg))  # the steps object lives only in _serve's frame
    _finish()


class Ranks:
    """Rank 0 of ``world`` Gloo ranks, each holding ``make(rank, cfg)`` (this rank's is ``self.steps``)."""

    def __init__(self, name: str, world: int, make: Callable, cfg) -> None:
        if dist.is_initialized():
            raise RuntimeError(f"{name} needs a process without a process group")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.threads = torch.get_num_threads()
        per_rank = max(1, self.threads // world)  # the ranks share this machine's cores
        self.ctx = mp.start_processes(_follower, args=(world, port, per_rank, make, cfg), nprocs=world - 1,
                                      join=False, start_method="spawn")
        _init(0, world, port, per_rank)
        self.steps = make(0, cfg)
        self.cmd = torch.zeros(1, dtype=torch.int64)
        self.closed = False

    def announce(self, which: int) -> None:
        """Tell the followers which step comes (rank 0 then runs its own part itself)."""
        self.cmd.fill_(which)
        dist.broadcast(self.cmd, 0)

    def step(self, which: int) -> None:
        self.announce(which)
        self.steps.run(which)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.announce(STOP)
        _close(self.steps)
        self.steps = None
        _finish()
        self.ctx.join()
        torch.set_num_threads(self.threads)

    def timed(self, ours: int, theirs: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """The two timed callables; the ranks stop once the harness has dropped both."""
        handle = _Handle(self)
        weakref.finalize(handle, self.close)
        return (lambda: handle.ranks.step(ours)), (lambda: handle.ranks.step(theirs))


def mlp(width: int, depth: int) -> torch.nn.Module:
    """The data-parallel cases' model: ``depth`` Linear+ReLU layers of ``width``, then 10 outputs (seed 0,
    so every rank starts from the same weights)."""
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def mlp_batch(rank: int, width: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's own inputs and class labels for :func:`mlp` (seeded by the rank: data differs per rank)."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(batch, width, generator=g), torch.randint(0, 10, (batch,), generator=g)


def mlp_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, optimizer=None) -> None:
    """One data-parallel step of :func:`mlp`: gradients cleared (``set_to_none``), cross-entropy forward and
    backward, then ``optimizer.step()`` (without an optimizer, the model's own gradients are cleared)."""
    (optimizer or model).zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if optimizer is not None:
        optimizer.step()


class _Handle:
    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
