"""FusedLAMB: CPU step against a per-parameter loop; Triton bytes and launches per step.

Minimum traffic: 28 bytes per fp32 parameter (read g, p, m, v; write p, m, v). With the trust ratio the
Triton path makes three passes (the global gradient norm, then moments + per-tensor norms, then the
update), requesting 44 bytes per parameter; every byte it touches is one of the 28 (unique bytes)."""

from __future__ import annotations

from apex.optimizers import FusedLAMB
from benchmarks.optimizers._lamb_cases import cases_for
from benchmarks.optimizers._loop_refs import LoopLAMB


def cases():
    return cases_for("FusedLAMB", lambda ps: FusedLAMB(ps, lr=1e-3), lambda ps: LoopLAMB(ps, lr=1e-3), 28,
                     note="triton bytes = distinct addresses (16 B/param: g, p, m, v each touched); "
                     "requested 44 B/param (norm pass 4, moments 24, apply 16) vs the 28 B minimum")
