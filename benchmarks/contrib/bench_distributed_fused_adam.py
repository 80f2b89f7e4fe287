"""Training steps (zero_grad, forward, backward, optimizer step; four per timed call) with apex's
``DistributedFusedAdam`` (ZeRO-2: reduce-scatter of gradients in backward hooks, sharded Adam, all-gather of
parameters) against ``torch.nn.parallel.DistributedDataParallel`` + ``apex.optimizers.FusedAdam``
(all-reduce, full Adam on every rank), on 2 Gloo ranks of this machine.

As in ``benchmarks/parallel/bench_ddp.py``, the benchmark process is rank 0 and spawns rank 1, which mirrors
every step (rank 0 broadcasts which variant runs next). The facts kept in ``extra``: optimizer-state bytes
per rank (ours vs FusedAdam's), and bytes handed to collectives per step against ZeRO-2's minimum (one
reduce-scatter of the gradients + one all-gather of the parameters, unpadded).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from benchmarks._harness import Case
from benchmarks._ranks import Ranks, mlp, mlp_batch, mlp_step

BUCKET_MB = 4.0
CONFIGS = [(512, 4, 32), (128, 24, 32)]  # (width, depth, batch): a few large layers, many small ones
OURS, THEIRS = 1, 2
# Steps per timed call. With overlap_param_sync a step ends with its all-gathers in flight, to be finished by
# the next forward; timed one step at a time, that transfer would run during the other side's step, which
# runs next in the interleaved timing, and be charged to it. Back-to-back steps pay for their own.
STEPS = 4


class _Steps:
    def __init__(self, rank: int, cfg: tuple[int, int, int, bool]):
        from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
        from apex.optimizers import FusedAdam

        width, depth, batch, overlap_param_sync = cfg
        self.ours_model = mlp(width, depth)
        self.ours = DistributedFusedAdam(self.ours_model.parameters(), lr=1e-4, bucket_cap_mb=BUCKET_MB,
                                         overlap_grad_sync=True, overlap_param_sync=overlap_param_sync)
        self.theirs_model = nn.parallel.DistributedDataParallel(mlp(width, depth), bucket_cap_mb=BUCKET_MB)
        self.theirs = FusedAdam(self.theirs_model.parameters(), lr=1e-4)
        self.x, self.y = mlp_batch(rank, width, batch)

    def run(self, which: int) -> None:
        model, opt = (self.ours_model, self.ours) if which == OURS else (self.theirs_model, self.theirs)
        for _ in range(STEPS):
            mlp_step(model, self.x, self.y, opt)


def _report(ranks: Ranks) -> dict:
    opt = ranks.steps.ours
    before = dict(opt.comm_stats)
    ranks.step(OURS)
    moved = {k: (opt.comm_stats[k] - before[k]) // STEPS for k in before}
    n = sum(p.numel() for p in ranks.steps.ours_model.parameters())
    minimum = n * torch.finfo(opt.grad_sync_dtype).bits // 8 + n * torch.finfo(opt.param_sync_dtype).bits // 8
    ours_bytes = sum(b.state_bytes() for b in opt.state["buckets"])
    theirs_bytes = sum(t.numel() * t.element_size() for s in ranks.steps.theirs.state.values()
                       for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
    facts = {"params": n, "buckets": len(opt.state["buckets"]),
             "state_bytes_per_rank": ours_bytes, "fused_adam_state_bytes": theirs_bytes,
             "state_fraction": round(ours_bytes / theirs_bytes, 3),
             "comm_bytes_per_step": sum(moved.values()), "zero2_min_bytes": minimum,
             "comm_vs_min": round(sum(moved.values()) / minimum, 3), **moved}
    print(f"bench_distributed_fused_adam: {n} params in {facts['buckets']} bucket(s); optimizer state "
          f"{ours_bytes} B/rank (m, v, fp32 master shard) vs FusedAdam {theirs_bytes} B (m, v) = "
          f"{facts['state_fraction']}x; collectives {sum(moved.values())} B/step vs ZeRO-2 minimum {minimum} B "
          f"= {facts['comm_vs_min']}x", file=sys.stderr, flush=True)
    return facts


def _timed(cfg):
    ranks = Ranks("bench_distributed_fused_adam", 2, _Steps, cfg)
    ranks.step(OURS)  # the first step builds the buckets
    ranks.step(THEIRS)
    facts = _report(ranks)
    return (*ranks.timed(OURS, THEIRS), facts)


def cases():
    # overlap_param_sync (NeMo's usual setting): each parameter's all-gathered value is written at its first
    # use in the next forward instead of at the end of step().
    return [Case(f"distributed_fused_adam {STEPS} steps 2 ranks MLP {depth}x{width} batch {batch}"
                 + (" overlap_param_sync" if overlap else ""),
                 timed=lambda cfg=(width, depth, batch, overlap): _timed(cfg), torch_label="torch DDP + FusedAdam",
                 repeats=21, warmup=2)
            for overlap in (False, True) for width, depth, batch in CONFIGS]
