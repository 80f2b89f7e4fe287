"""One training step (forward, backward, gradient reduction, LAMB update, parameter sync) with apex's
``DistributedFusedLAMB`` (ZeRO: reduce-scatter, sharded update, all-gather) and with
``torch.nn.parallel.DistributedDataParallel`` + ``apex.optimizers.FusedLAMB`` (all-reduce, full update on
every rank), on 2 Gloo ranks of this machine.

The benchmark process is rank 0; the case spawns rank 1, which mirrors every step rank 0 takes (rank 0
broadcasts which setup runs next). The result's ``extra`` keeps the optimizer state bytes per rank of both
(ours: fp32 master + two moments of the shard; theirs: the two moments of every parameter, the fp32
parameters being their own masters) and the bytes each rank sends per step in ring collectives, against
ZeRO-2's minimum (one reduce-scatter of the gradients and one all-gather of the parameters); ours adds the
padding of the flat buffer and two small all-reduces (the global norm and the per-parameter norms).
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

# (width, depth, batch)
CONFIGS = [(512, 4, 64), (128, 24, 64)]
STOP, OURS, THEIRS = 0, 1, 2
LAMB = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class _Steps:
    def __init__(self, rank: int, cfg):
        from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB
        from apex.optimizers import FusedLAMB

        width, depth, batch = cfg
        self.ours_model = _model(width, depth)
        self.ours = DistributedFusedLAMB(self.ours_model.parameters(), dwu_num_blocks=4, dwu_num_chunks=1, **LAMB)
        self.theirs_model = nn.parallel.DistributedDataParallel(_model(width, depth))
        self.theirs = FusedLAMB(self.theirs_model.parameters(), **LAMB)
        g = torch.Generator().manual_seed(rank)
        self.x = torch.randn(batch, width, generator=g)
        self.y = torch.randint(0, 10, (batch,), generator=g)
        self.cmd = torch.zeros(1, dtype=torch.int64)

    def run(self, which: int) -> None:
        model, opt = (self.ours_model, self.ours) if which == OURS else (self.theirs_model, self.theirs)
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(self.x), self.y).backward()
        opt.step()  # DistributedFusedLAMB completes its reductions itself

    def facts(self) -> dict:
        lay = self.ours._layout
        ours_state = sum(t.numel() * t.element_size() for t in (self.ours._fp32_p, self.ours._fp32_m,
                                                               self.ours._fp32_v))
        theirs_state = sum(t.numel() * t.element_size() for s in self.theirs.state.values() for t in s.values()
                           if isinstance(t, torch.Tensor))
        n, w, es = lay.total, lay.world, self.ours._flat_grads.element_size()
        ring = (w - 1) / w  # bytes a rank sends in a ring collective, per byte of the full tensor
        ours_sent = ring * es * 2 * lay.padded + 2 * ring * 4 * (1 + 2 * len(self.ours._model_params))
        zero2_min = ring * es * 2 * n  # one reduce-scatter of the gradients + one all-gather of the parameters
        return {"params": n, "ours_state_bytes_per_rank": ours_state,
                "ddp_fused_lamb_state_bytes_per_rank": theirs_state,
                "ours_state_vs_full_fp32_master_m_v": ours_state / (3 * 4 * n),
                "ours_bytes_sent_per_rank": int(ours_sent), "zero2_min_bytes_sent_per_rank": int(zero2_min),
                "ours_bytes_vs_min": ours_sent / zero2_min,
                "ddp_bytes_sent_per_rank": int(2 * ring * 4 * n)}  # one all-reduce


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
        steps.run(which)
    dist.destroy_process_group()


class _TwoRanks:
    def __init__(self, cfg):
        if dist.is_initialized():
            raise RuntimeError("bench_distributed_fused_lamb needs a process without a process group")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
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
        self.steps.run(which)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
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
    pair.step(OURS)
    pair.step(THEIRS)  # FusedLAMB creates its state on the first step
    facts = pair.steps.facts()
    print(f"bench_distributed_fused_lamb: {facts}", file=sys.stderr, flush=True)
    handle = _Handle(pair)
    weakref.finalize(handle, pair.close)  # rank 1 stops once the harness drops both callables
    return (lambda: handle.pair.step(OURS)), (lambda: handle.pair.step(THEIRS)), facts


def cases():
    return [Case(f"DistributedFusedLAMB step 2 ranks MLP {depth}x{width} batch {batch}",
                 timed=lambda cfg=(width, depth, batch): _timed(cfg), torch_label="torch DDP + FusedLAMB",
                 repeats=9, warmup=2)
            for width, depth, batch in CONFIGS]
