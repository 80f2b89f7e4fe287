"""GPU-sized FusedAdam cases (``benchmarks/run.py --device cuda``): fp32 AdamW, weight decay 0.01, one step
against ``torch.optim.AdamW`` fused and foreach, on one large parameter set and on the many-tensor sets
where the step's host time dominates. Minimum: 28 bytes per parameter (read p, g, m, v; write p, m, v)."""

from __future__ import annotations

import torch

from benchmarks._gpu import FP32, GpuCase, Impl, generator

LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
BYTES_PER_PARAM = 28
# label -> (count, size) or (count, "mixed", mean size)
GPU_SETS = {"24x4096^2": (24, 4096 * 4096), "100x1M": (100, 1_000_000),
            "1000 mixed (96M)": (1000, "mixed", 96_000), "1000x96K": (1000, 96_000), "10000x10K": (10_000, 10_000)}


def sizes(spec) -> list[int]:
    if spec[1] == "mixed":  # uniform in [1, 2·mean): about count·mean elements
        g = torch.Generator().manual_seed(0)
        return torch.randint(1, 2 * spec[2], (spec[0],), generator=g).tolist()
    return [spec[1]] * spec[0]


def _inputs(spec, device):
    g = generator(device)
    params, grads = [], []
    for n in sizes(spec):
        params.append(torch.randn(n, generator=g, device=device).requires_grad_())
        grads.append(torch.randn(n, generator=g, device=device))
    return {"params": params, "grads": grads}


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _builder(factory):
    def build(inputs) -> Impl:
        params = inputs["params"]
        for p, gr in zip(params, inputs["grads"]):
            p.grad = gr
        before = _flat(params)
        opt = factory(params)
        # One step from fresh state is what is checked (the first call); the later, timed steps reuse the state.
        return Impl(forward=opt.step, result=lambda: _flat(params).double() - before.double())
    return build


def reference(inputs) -> torch.Tensor:
    """The first step's update in fp64: decoupled decay, then the bias-corrected Adam step."""
    p, g = _flat(inputs["params"]).double(), _flat(inputs["grads"]).double()
    b1, b2 = BETAS
    m_hat = g  # (1 - b1)·g / (1 - b1)
    v_hat = g * g
    return -LR * WD * p - LR * m_hat / (v_hat.sqrt() + EPS)


def gpu_cases(sets=None) -> list[GpuCase]:
    from apex.optimizers import FusedAdam

    impls = {
        "apex": _builder(lambda ps: FusedAdam(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)),
        "torch fused": _builder(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                             fused=True)),
        "torch foreach": _builder(lambda ps: torch.optim.AdamW(ps, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                               foreach=True)),
    }
    out = []
    for i, (label, spec) in enumerate((sets or GPU_SETS).items()):
        n = sum(sizes(spec))
        out.append(GpuCase("fused_adam", "step", label, FP32, BYTES_PER_PARAM * n,
                           make=lambda device, spec=spec: _inputs(spec, device), impls=impls, reference=reference,
                           quick=i == 0, note="fp32 AdamW, weight decay 0.01; torch.compile and Liger: not applicable"))
    return out
