"""Running code that compiles Triton kernels for a GPU target, from a test that runs under the interpreter.

This process decorated the kernels with ``TRITON_INTERPRET`` on, so a compile runs in a child process without
it. A Triton install without the target's toolchain (``ptxas``, ROCm's ``ld.lld``, ``cuobjdump``) cannot
compile: the test skips, naming why, rather than failing on the machine it cannot check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_TOOLS = ("ptxas", "ld.lld", "cuobjdump")


def run_uninterpreted(args: Sequence[str], *, cwd: Path = ROOT, timeout: float = 600,
                      env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python *args`` without ``TRITON_INTERPRET`` and ``APEX_BACKEND`` (``env`` adds to the rest), with this
    checkout and its compiled-extension names importable; skips the calling test where the toolchain is
    missing, asserts exit status 0 otherwise (its output in the message)."""
    child = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "APEX_BACKEND")}
    child["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "apex" / "_compat"), child.get("PYTHONPATH", "")])
    child.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    child.update(env or {})
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=child, cwd=cwd,
                          timeout=timeout)
    out = proc.stdout + proc.stderr  # (a checker lists its failures on stdout, a crash goes to stderr)
    if proc.returncode != 0 and "not found" in out and any(tool in out for tool in _TOOLS):
        pytest.skip("no GPU compiler toolchain in this triton install")
    assert proc.returncode == 0, out[-4000:]
    return proc
