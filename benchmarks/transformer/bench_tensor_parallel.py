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

import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks._harness import Case
from benchmarks._ranks import Ranks

# (hidden, sequence, batch, sequence_parallel)
CONFIGS = [(256, 128, 4, False), (256, 128, 4, True)]
OURS, THEIRS = 1, 2
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
        self.rank = rank

    def run(self, which: int) -> None:
        if which == OURS:
            self.ours()
        elif self.rank == 0:  # the one-process baseline runs on rank 0 only
            self.theirs()

    def close(self) -> None:
        from apex.transformer import parallel_state

        parallel_state.destroy_model_parallel()

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


def _count(ranks: Ranks, sp: bool) -> dict:
    """Collectives issued by one tensor-parallel step, by kind."""
    ranks.announce(OURS)
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
        ranks.steps.ours()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    minimum = 4 if sp else 2
    facts = {"collectives_per_step": sum(counts.values()), "collectives_min": minimum,
             "collectives_by_kind": dict(counts)}
    print(f"bench_tensor_parallel: {facts['collectives_per_step']} collectives per step "
          f"(minimum {minimum}): {dict(counts)}", file=sys.stderr, flush=True)
    return facts


def _timed(cfg):
    ranks = Ranks("bench_tensor_parallel", 2, _Steps, cfg)
    facts = _count(ranks, cfg[3])
    return (*ranks.timed(OURS, THEIRS), facts)


def cases():
    return [Case(f"TP=2 MLP step h={h} s={s} b={b}{' sequence-parallel' if sp else ''}",
                 timed=lambda cfg=(h, s, b, sp): _timed(cfg), torch_label="1 process", repeats=9, warmup=2)
            for h, s, b, sp in CONFIGS]
