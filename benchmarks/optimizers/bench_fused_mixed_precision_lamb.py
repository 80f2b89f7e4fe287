"""FusedMixedPrecisionLamb on bf16 parameters with fp32 masters: CPU step against a per-parameter loop
(on fp32 copies), Triton bytes and launches per step.

Minimum traffic per parameter: read g (2), master (4), m (4), v (4); write master, m, v (12) and the bf16
parameter (2): 28 bytes."""

from __future__ import annotations

import torch

from apex.optimizers import FusedMixedPrecisionLamb
from benchmarks.optimizers._lamb_cases import cases_for
from benchmarks.optimizers._loop_refs import LoopLAMB


def _loop(params):
    # The loop baseline keeps fp32 masters too: each step it takes the model's bf16 gradients in fp32 (as
    # the optimizer does: they arrive in bf16 from every backward), steps the fp32 copies and rounds them
    # into the model.
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    inner = LoopLAMB(masters, lr=1e-3)

    class _Step:
        @torch.no_grad()
        def step(self):
            for m, p in zip(masters, params):
                m.grad = p.grad.float()
            inner.step()
            for m, p in zip(masters, params):
                p.copy_(m)

    return _Step()


def cases():
    return cases_for("FusedMixedPrecisionLamb",
                     lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-3, reduced_precision_dtype=torch.bfloat16),
                     _loop, 28, dtype=torch.bfloat16, note="bf16 params, fp32 masters and moments")
