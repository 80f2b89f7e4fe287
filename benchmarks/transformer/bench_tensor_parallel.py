"""One training step (forward + backward) of a Megatron MLP block, h -> 4h (ColumnParallelLinear) -> GELU
-> h (RowParallelLinear), with tensor parallelism over 2 Gloo ranks of this machine, against the same block
(nn.Linear -> GELU -> nn.Linear) in one process.

The benchmark process is rank 0 and spawns rank 1, which mirrors each tensor-parallel step (rank 0
broadcasts what runs next; the one-process step pays the same small broadcast). Each rank gets half the
machine's threads and the one-process baseline the same count, so the ratio shows the communication
overhead against halving the work per rank. The collectives issued by one tensor-parallel step are
counted by wrapping ``torch.distributed`` and compared with the minimum the layout needs (one all-reduce
forward after the row-parallel layer, one backward for the column-parallel input gradient; with sequence
parallelism an all-gather and a reduce-scatter each way).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import weakref
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from benchmarks._harness import Case

# (hidden, sequence, batch, sequence_parallel)
CONFIGS = [(256, 128, 4, False), (256, 128, 4, True)]
STOP, OURS, THEIRS = 0, 1, 2
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")


class _Steps:
    def __init__(self, rank: int, cfg):
        from apex.transformer import parallel_state
        from apex.transformer.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        hidden, seq, batch, sp = cfg
        parallel_state.initialize_model_parallel(2)
        torch.manual_seed(0)
        self.col = ColumnParallelLinear(hidden, 4 * hidden, gather_output=False, use_cpu_initialization=True,
                                        sequence_parallel_enabled=sp, no_async_tensor_model_parallel_allreduce=sp)
        self.row = RowParallelLinear(4 * hidden, hidden, input_is_parallel=True, use_cpu_initialization=True,
                                     sequence_parallel_enabled=sp)
        self.ref1, self.ref2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(seq, batch, hidden, generator=g)
        self.x_tp = x.chunk(2, 0)[rank].clone() if sp else x
        self.x = x
        self.cmd = torch.zeros(1, dtype=torch.int64)

    def ours(self) -> None:
        for p in (*self.col.parameters(), *self.row.parameters()):
            p.grad = None
        h, _ = self.col(self.x_tp.requires_grad_())
        out, _ = self.row(F.gelu(h))
        out.sum().backward()

    def theirs(self) -> None:
        for p in (*self.ref1.parameters(), *self.ref2.parameters()):
            p.grad = None
        self.ref2(F.gelu(self.ref1(self.x.requires_grad_()))).sum().backward()


def _follower(rank: int, port: int, threads: int, cfg) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=1, world_size=2, timeout=datetime.timedelta(seconds=120))
    steps = _Steps(1, cfg)
    while True:
        dist.broadcast(steps.cmd, 0)
        which = int(steps.cmd.item())
        if which == STOP:
            break
        if which == OURS:
            steps.ours()
    dist.destroy_process_group()


class _TwoRanks:
    def __init__(self, cfg):
        if dist.is_initialized():
            raise RuntimeError("bench_tensor_parallel needs a process without a process group")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.cfg = cfg
        self.threads = torch.get_num_threads()
        per_rank = max(1, self.threads // 2)
        self.ctx = mp.start_processes(_follower, args=(port, per_rank, cfg), nprocs=1, join=False,
                                      start_method="spawn")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=2, timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(per_rank)
        self.steps = _Steps(0, cfg)
        self.closed = False

    def step(self, which: int) -> None:
        self.steps.cmd.fill_(which)
        dist.broadcast(self.steps.cmd, 0)
        (self.steps.ours if which == OURS else self.steps.theirs)()

    def count(self) -> dict:
        """Collectives issued by one tensor-parallel step, by kind."""
        self.steps.cmd.fill_(OURS)
        dist.broadcast(self.steps.cmd, 0)
        counts: Counter = Counter()
        originals = {name: getattr(dist, name) for name in _COLLECTIVES}

        def wrap(name):
            def counted(*args, **kwargs):
                counts[name] += 1
                return originals[name](*args, **kwargs)
            return counted

        try:
            for name in _COLLECTIVES:
                setattr(dist, name, wrap(name))
            self.steps.ours()
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        sp = self.cfg[3]
        minimum = 4 if sp else 2
        facts = {"collectives_per_step": sum(counts.values()), "collectives_min": minimum,
                 "collectives_by_kind": dict(counts)}
        print(f"bench_tensor_parallel: {facts['collectives_per_step']} collectives per step "
              f"(minimum {minimum}): {dict(counts)}", file=sys.stderr, flush=True)
        return facts

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        from apex.transformer import parallel_state

        parallel_state.destroy_model_parallel()
        self.steps.cmd.fill_(STOP)
        dist.broadcast(self.steps.cmd, 0)
        dist.destroy_process_group()
        self.ctx.join()
        torch.set_num_threads(self.threads)


class _Handle:
    def __init__(self, pair):
        self.pair = pair


def _timed(cfg):
    pair = _TwoRanks(cfg)
    facts = pair.count()
    handle = _Handle(pair)
    weakref.finalize(handle, pair.close)  # rank 1 stops once the harness drops both callables
    return (lambda: handle.pair.step(OURS)), (lambda: handle.pair.step(THEIRS)), facts


def cases():
    return [Case(f"TP=2 MLP step h={h} s={s} b={b}{' sequence-parallel' if sp else ''}",
                 timed=lambda cfg=(h, s, b, sp): _timed(cfg), torch_label="1 process", repeats=9, warmup=2)
            for h, s, b, sp in CONFIGS]
