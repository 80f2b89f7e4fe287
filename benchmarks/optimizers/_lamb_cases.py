"""Case builders shared by the LAMB / NovoGrad / mixed-precision LAMB benchmarks."""

from __future__ import annotations

import random

import torch

from benchmarks._harness import Case, Counted

BIG = [10_000_000]


def mixed_sizes(n: int = 1000, seed: int = 0) -> list[int]:
    """``n`` parameter sizes from a transformer-like mix: biases, norms, small and large matrices."""
    rng = random.Random(seed)
    return [rng.choice([64, 768, 3072, 4096, 30_000]) for _ in range(n)]


def make_params(sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(dtype)
    return params


def cases_for(name: str, make_ours, make_loop, bytes_per_elem: int, dtype=torch.float32,
              note: str = "") -> list[Case]:
    """Two timed cases (1 x 10M, 1,000 mixed) against a per-parameter loop, and two counted cases under
    the interpreter (1 x 65,537 and 100 mixed small tensors) against the minimum bytes and eager PyTorch."""

    def timed(sizes):
        def build():
            ours = make_ours(make_params(sizes, dtype))
            loop = make_loop(make_params(sizes, dtype))
            return ours.step, loop.step
        return build

    def counted(sizes):
        def build():
            ours = make_ours(make_params(sizes, dtype, seed=1))
            loop = make_loop(make_params(sizes, dtype, seed=1))
            with torch.no_grad():
                ours.step()  # state exists: the counted step is a steady-state step
            return Counted(triton=ours.step, eager=loop.step, bytes_min=bytes_per_elem * sum(sizes),
                           note=note)
        return build

    small = [random.Random(1).choice([1, 7, 300, 1000, 4097]) for _ in range(100)]
    return [
        Case(f"{name} 1x10M", timed=timed(BIG), torch_label="per-param loop", repeats=11, warmup=2),
        Case(f"{name} 1000 mixed", timed=timed(mixed_sizes()), torch_label="per-param loop", repeats=11,
             warmup=2),
        Case(f"{name} 1x65537 (counted)", counted=counted([65_537])),
        Case(f"{name} 100 mixed (counted)", counted=counted(small)),
    ]
