"""FusedNovoGrad: CPU step against a per-parameter loop; Triton bytes and launches per step.

Minimum traffic: 20 bytes per fp32 parameter (read g, p, m; write p, m). The per-tensor gradient norm
must be known before the update, so the gradients are read twice (24 bytes requested, 20 unique)."""

from __future__ import annotations

from apex.optimizers import FusedNovoGrad
from benchmarks.optimizers._lamb_cases import cases_for
from benchmarks.optimizers._loop_refs import LoopNovoGrad


def cases():
    return cases_for("FusedNovoGrad", lambda ps: FusedNovoGrad(ps, lr=1e-3, betas=(0.95, 0.98)),
                     lambda ps: LoopNovoGrad(ps, lr=1e-3), 20,
                     note="3 passes: the gradient norms (4 B/param), then the update (20 B/param), "
                     "against the single-pass 20 B minimum")
