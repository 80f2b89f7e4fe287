"""One training step (forward, backward, gradient all-reduce) under apex's DistributedDataParallel and
under ``torch.nn.parallel.DistributedDataParallel``, on 2 Gloo ranks of this machine.

The benchmark process is rank 0; the case spawns rank 1, which mirrors every step rank 0 takes (rank 0
broadcasts which wrapper runs next, so the two ranks' collectives always match; both timings pay that
same small broadcast). Both wrappers get the same model, data and bucket size (10 MB). The number of
all-reduce calls per step and the number of buckets are kept in the result's ``extra`` (and printed).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from benchmarks._harness import Case

BUCKET_MB = 10
# (width, depth, batch): a few large layers (bandwidth-bound all-reduce) and many small ones (per-hook cost).
CONFIGS = [(1024, 6, 64), (128, 48, 64)]
STOP, OURS, THEIRS = 0, 1, 2


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class _Steps:
    """Both wrappers on this rank, one step of either on demand."""

    def __init__(self, rank: int, cfg: tuple[int, int, int]):
        from apex.parallel import DistributedDataParallel as ApexDDP

        width, depth, batch = cfg
        self.ours = ApexDDP(_model(width, depth), message_size=BUCKET_MB * 2**20 // 4)
        self.theirs = nn.parallel.DistributedDataParallel(_model(width, depth), bucket_cap_mb=BUCKET_MB)
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randn(batch, width, generator=g)
        self.y = torch.randint(0, 10, (batch,), generator=g)
        self.cmd = torch.zeros(1, dtype=torch.int64)

    def run(self, which: int) -> None:
        model = self.ours if which == OURS else self.theirs
        model.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(self.x), self.y).backward()


def _follower(rank: int, port: int, threads: int, cfg: tuple[int, int, int]) -> None:
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=1, world_size=2, timeout=datetime.timedelta(seconds=120))
    steps = _Steps(1, cfg)
    while True:
        dist.broadcast(steps.cmd, 0)
        which = int(steps.cmd.item())
        if which == STOP:
            break
        steps.run(which)
    dist.destroy_process_group()


class _TwoRanks:
    def __init__(self, cfg: tuple[int, int, int]):
        if dist.is_initialized():
            raise RuntimeError("bench_ddp needs a process without a process group")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.threads = torch.get_num_threads()
        per_rank = max(1, self.threads // 2)  # two ranks share this machine's cores
        self.ctx = mp.start_processes(_follower, args=(port, per_rank, cfg), nprocs=1, join=False,
                                      start_method="spawn")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=0, world_size=2, timeout=datetime.timedelta(seconds=120))
        torch.set_num_threads(per_rank)
        self.steps = _Steps(0, cfg)
        self.closed = False
        self.ours_steps = 0

    def step(self, which: int) -> None:
        self.steps.cmd.fill_(which)
        dist.broadcast(self.steps.cmd, 0)
        self.steps.run(which)

    def report(self) -> dict:
        ours = self.steps.ours
        calls0 = ours.allreduce_calls
        self.step(OURS)
        per_step = ours.allreduce_calls - calls0
        data = self.steps.theirs._get_ddp_logging_data()
        facts = {"allreduce_calls_per_step": per_step, "buckets": ours.num_buckets,
                 "bucket_sizes_params": list(ours.bucket_sizes),
                 "torch_ddp_bucket_sizes_bytes": data.get("bucket_sizes", "?")}
        print(f"bench_ddp: apex DDP {per_step} all-reduce call(s) per step for {ours.num_buckets} bucket(s) "
              f"(sizes {ours.bucket_sizes} params); torch DDP bucket sizes {facts['torch_ddp_bucket_sizes_bytes']} "
              "bytes (one all-reduce each)", file=sys.stderr, flush=True)
        return facts

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.steps.cmd.fill_(STOP)
        dist.broadcast(self.steps.cmd, 0)
        dist.destroy_process_group()
        self.ctx.join()
        torch.set_num_threads(self.threads)


def _timed(cfg):
    pair = _TwoRanks(cfg)
    pair.step(OURS)  # the first step builds apex's bucket structure
    facts = pair.report()
    handle = _Handle(pair)
    weakref.finalize(handle, pair.close)  # rank 1 stops once the harness drops both callables
    return (lambda: handle.pair.step(OURS)), (lambda: handle.pair.step(THEIRS)), facts


class _Handle:
    def __init__(self, pair):
        self.pair = pair


def cases():
    return [Case(f"ddp step 2 ranks MLP {depth}x{width} batch {batch}",
                 timed=lambda cfg=(width, depth, batch): _timed(cfg), torch_label="torch DDP", repeats=15, warmup=3)
            for width, depth, batch in CONFIGS]
