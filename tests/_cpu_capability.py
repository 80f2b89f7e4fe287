"""Run a probe script under every ``ATEN_CPU_CAPABILITY`` this CPU can execute.

PyTorch picks its CPU kernels by the widest vector extension the CPU has (``DEFAULT`` and ``AVX2`` use
8-float vectors, ``AVX512`` 16), and a reduction's summation order follows the vector width; tests that
claim results independent of the CPU compare a probe's output across the capabilities reachable here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_capabilities() -> list[str]:
    """The ``ATEN_CPU_CAPABILITY`` values this CPU can run: ``default``, and the vector extensions up to the
    one PyTorch picks by itself (forcing a wider one than the CPU has ends in SIGILL)."""
    best = torch.backends.cpu.get_cpu_capability() if "ATEN_CPU_CAPABILITY" not in os.environ else None
    if best is None:
        probe = [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"]
        env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
        best = subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip()
    ladder = {"AVX2": ["avx2"], "AVX512": ["avx2", "avx512"]}
    return ["default", *ladder.get(best, [])]


def probe_under_capabilities(script: str) -> dict[str, dict]:
    """Run ``script`` (printing a JSON object) once per CPU capability; ``{capability: its output}``."""
    outs = {}
    for cap in cpu_capabilities():
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap, APEX_BACKEND="torch")
        run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, f"ATEN_CPU_CAPABILITY={cap}:\n{run.stderr[-3000:]}"
        outs[cap] = json.loads(run.stdout)
    return outs
