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

import sys

import torch
from torch import nn

from benchmarks._harness import Case
from benchmarks._ranks import Ranks, mlp, mlp_batch, mlp_step

# (width, depth, batch)
CONFIGS = [(512, 4, 64), (128, 24, 64)]
OURS, THEIRS = 1, 2
LAMB = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)


class _Steps:
    def __init__(self, rank: int, cfg):
        from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB
        from apex.optimizers import FusedLAMB

        width, depth, batch = cfg
        self.ours_model = mlp(width, depth)
        self.ours = DistributedFusedLAMB(self.ours_model.parameters(), dwu_num_blocks=4, dwu_num_chunks=1, **LAMB)
        self.theirs_model = nn.parallel.DistributedDataParallel(mlp(width, depth))
        self.theirs = FusedLAMB(self.theirs_model.parameters(), **LAMB)
        self.x, self.y = mlp_batch(rank, width, batch)

    def run(self, which: int) -> None:
        # DistributedFusedLAMB completes its reductions itself in step()
        if which == OURS:
            mlp_step(self.ours_model, self.x, self.y, self.ours)
        else:
            mlp_step(self.theirs_model, self.x, self.y, self.theirs)

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


def _timed(cfg):
    ranks = Ranks("bench_distributed_fused_lamb", 2, _Steps, cfg)
    ranks.step(OURS)
    ranks.step(THEIRS)  # FusedLAMB creates its state on the first step
    facts = ranks.steps.facts()
    print(f"bench_distributed_fused_lamb: {facts}", file=sys.stderr, flush=True)
    return (*ranks.timed(OURS, THEIRS), facts)


def cases():
    return [Case(f"DistributedFusedLAMB step 2 ranks MLP {depth}x{width} batch {batch}",
                 timed=lambda cfg=(width, depth, batch): _timed(cfg), torch_label="torch DDP + FusedLAMB",
                 repeats=9, warmup=2)
            for width, depth, batch in CONFIGS]
