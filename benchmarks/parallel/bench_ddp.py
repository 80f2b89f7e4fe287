"""One training step (forward, backward, gradient all-reduce) under apex's DistributedDataParallel and
under ``torch.nn.parallel.DistributedDataParallel``, on 2 Gloo ranks of this machine.

The benchmark process is rank 0; the case spawns rank 1, which mirrors every step rank 0 takes (rank 0
broadcasts which wrapper runs next, so the two ranks' collectives always match; both timings pay that
same small broadcast). Both wrappers get the same model, data and bucket size (10 MB). The number of
all-reduce calls per step and the number of buckets are kept in the result's ``extra`` (and printed).
"""

from __future__ import annotations

import sys

from torch import nn

from benchmarks._harness import Case
from benchmarks._ranks import Ranks, mlp, mlp_batch, mlp_step

BUCKET_MB = 10
# (width, depth, batch): a few large layers (bandwidth-bound all-reduce) and many small ones (per-hook cost).
CONFIGS = [(1024, 6, 64), (128, 48, 64)]
OURS, THEIRS = 1, 2


class _Steps:
    """Both wrappers on this rank, one step of either on demand."""

    def __init__(self, rank: int, cfg: tuple[int, int, int]):
        from apex.parallel import DistributedDataParallel as ApexDDP

        width, depth, batch = cfg
        self.ours = ApexDDP(mlp(width, depth), message_size=BUCKET_MB * 2**20 // 4)
        self.theirs = nn.parallel.DistributedDataParallel(mlp(width, depth), bucket_cap_mb=BUCKET_MB)
        self.x, self.y = mlp_batch(rank, width, batch)

    def run(self, which: int) -> None:
        mlp_step(self.ours if which == OURS else self.theirs, self.x, self.y)


def _report(ranks: Ranks) -> dict:
    ours = ranks.steps.ours
    calls0 = ours.allreduce_calls
    ranks.step(OURS)
    per_step = ours.allreduce_calls - calls0
    data = ranks.steps.theirs._get_ddp_logging_data()
    facts = {"allreduce_calls_per_step": per_step, "buckets": ours.num_buckets,
             "bucket_sizes_params": list(ours.bucket_sizes),
             "torch_ddp_bucket_sizes_bytes": data.get("bucket_sizes", "?")}
    print(f"bench_ddp: apex DDP {per_step} all-reduce call(s) per step for {ours.num_buckets} bucket(s) "
          f"(sizes {ours.bucket_sizes} params); torch DDP bucket sizes {facts['torch_ddp_bucket_sizes_bytes']} "
          "bytes (one all-reduce each)", file=sys.stderr, flush=True)
    return facts


def _timed(cfg):
    ranks = Ranks("bench_ddp", 2, _Steps, cfg)
    ranks.step(OURS)  # the first step builds apex's bucket structure
    facts = _report(ranks)
    return (*ranks.timed(OURS, THEIRS), facts)


def cases():
    return [Case(f"ddp step 2 ranks MLP {depth}x{width} batch {batch}",
                 timed=lambda cfg=(width, depth, batch): _timed(cfg), torch_label="torch DDP", repeats=15, warmup=3)
            for width, depth, batch in CONFIGS]
