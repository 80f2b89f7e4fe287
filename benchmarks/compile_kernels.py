"""Compile every Triton kernel that the benchmark cases launch for GPUs that are not on this machine.

    python benchmarks/compile_kernels.py --target cuda:90 --target hip:gfx942
    python benchmarks/compile_kernels.py --no-timed -k layer_norm

Each case's Triton path runs on CPU tensors with every launch turned into an ahead-of-time compile
(:func:`apex.testing.triton_compile.check`): at the counted sizes, and at the timed sizes for the
single-process packages (the multi-rank cases spawn processes of their own). It fails on a call that
raises, on shared memory beyond the target's, and on a kernel in ``apex/_kernels`` that no case launches.
Run it in a process where ``TRITON_INTERPRET`` is unset.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_SINGLE_PROCESS = ("benchmarks.ops.", "benchmarks.optimizers.", "benchmarks.amp.")
TIMED = " (timed size)"


def calls(timed: bool = True):
    """(case name, callable) for every benchmark case's Triton-path calls."""
    from benchmarks.run import discover

    for _, case in discover():
        if case.counted is not None:
            yield case.name, lambda case=case: case.counted().triton()
        if timed and case.timed is not None and getattr(case.timed, "__module__", "").startswith(_SINGLE_PROCESS):
            yield case.name + TIMED, lambda case=case: case.timed()[0]()


def main(argv: list[str] | None = None) -> int:
    from apex.testing.triton_compile import check

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", help="cuda:90 (default), cuda:80, hip:gfx942, ...")
    p.add_argument("-k", default="", help="only benchmark cases whose name contains this text")
    p.add_argument("--no-timed", action="store_true", help="compile the counted sizes only")
    args = p.parse_args(argv)
    return check(lambda: calls(not args.no_timed), args.target or ["cuda:90"], args.k)


if __name__ == "__main__":
    sys.exit(main())
