"""Shared builders for the optimizer benchmarks: parameter sets, gradients, and the case factory."""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted


def params_1x10m(dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(10_000_000, generator=g).to(dtype))]


def params_mixed(n: int = 1000, max_size: int = 20000, seed: int = 0) -> list[torch.nn.Parameter]:
    """``n`` parameters of random sizes in [1, max_size), some of them 2-D (about 10M elements for 1,000)."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_size, (n,), generator=g).tolist()
    out = []
    for i, s in enumerate(sizes):
        shape = (s // 8, 8) if i % 3 == 0 and s >= 8 else (s,)
        out.append(torch.nn.Parameter(torch.randn(*shape, generator=g)))
    return out


def with_grads(params, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    return params


def twin(params):
    return with_grads([torch.nn.Parameter(p.detach().clone()) for p in params])


def make_cases(name: str, ours, theirs: dict, per_param_rw: int,
               eager: str | None = None) -> list[Case]:
    """Cases for one optimizer: ``ours(params)`` builds our optimizer, ``theirs[label](params)`` each
    PyTorch alternative. Timed: one step on 1 x 10M and on 1,000 mixed parameters. Counted under the
    interpreter at 60 mixed parameters (~60k elements), next to ``theirs[eager]`` (eager foreach)."""
    eager = eager or next(label for label in theirs if "foreach" in label)
    cases = []
    for size_label, build in (("1x10M", params_1x10m), ("1000 mixed", params_mixed)):
        for label, factory in theirs.items():
            def timed(build=build, factory=factory):
                a = with_grads(build())
                b = twin(a)
                opt_a, opt_b = ours(a), factory(b)
                opt_a.step()  # state allocation is not part of a step
                opt_b.step()
                return opt_a.step, opt_b.step

            cases.append(Case(f"{name} {size_label} fp32 vs {label}", timed=timed, torch_label=label,
                              repeats=15, warmup=2))

    def counted():
        a = with_grads(params_mixed(60, 2000, seed=3))
        b = twin(a)
        opt_a, opt_b = ours(a), theirs[eager](b)
        opt_a.step()
        opt_b.step()
        n = sum(p.numel() for p in a)
        return Counted(triton=opt_a.step, eager=opt_b.step, bytes_min=per_param_rw * n,
                       note=f"minimum {per_param_rw} B/param: every input read once, every output written once")

    cases.append(Case(f"{name} 60 mixed fp32 (interpreter count)", counted=counted, torch_label=eager))
    return cases
