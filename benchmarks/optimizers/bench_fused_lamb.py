"""FusedLAMB: CPU step against a per-parameter loop; Triton bytes and launches per step.

Minimum traffic: 28 bytes per fp32 parameter (read g, p, m, v; write p, m, v). With the trust ratio the
Triton path makes three passes (the global gradient norm, then moments + per-tensor norms, then the
update), moving 44 bytes per parameter."""

from __future__ import annotations

from apex.optimizers import FusedLAMB
from benchmarks.optimizers._lamb_cases import cases_for
from benchmarks.optimizers._loop_refs import LoopLAMB


def cases():
    return cases_for("FusedLAMB", lambda ps: FusedLAMB(ps, lr=1e-3), lambda ps: LoopLAMB(ps, lr=1e-3), 28,
                     note="3 passes: global gradient norm (4 B/param), moments + per-tensor norms (24), "
                     "apply (16); the 28 B minimum is a single pass")
