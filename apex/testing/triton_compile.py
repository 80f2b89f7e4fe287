"""Compile apex's Triton kernels for GPUs that are not on this machine.

The interpreter runs kernels with NumPy semantics, so it misses what only the compiler sees: type
promotion, constexpr misuse, unsupported ops, shared memory beyond what the target has. Compiling needs no
GPU. :func:`compile_only` turns every kernel launch into an ahead-of-time compile for a named target while
the launchers run on CPU tensors (their outputs stay uninitialised: run code for its launches, not its
results), and records what was compiled.

    python -m apex.testing.triton_compile --target cuda:90 --target hip:gfx942

compiles every launch the benchmark cases make (their counted and timed sizes) and checks each kernel
launched in ``apex/_kernels`` was compiled, with its shared memory within the target's limit. It must run
in a process where ``TRITON_INTERPRET`` is unset before any kernel module is imported.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import pkgutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

# Shared memory one block may use (opt-in maximum), per target.
SHARED_LIMIT = {"cuda:90": 232448, "cuda:80": 166912, "hip:gfx942": 65536, "hip:gfx90a": 65536}


@dataclass
class Compiled:
    """One compiled specialisation of a kernel."""

    kernel: str  # "module.function"
    target: str
    shared: int
    num_warps: int


@dataclass
class Record:
    target: str
    compiled: list[Compiled] = field(default_factory=list)

    def kernels(self) -> set[str]:
        return {c.kernel for c in self.compiled}


def parse_target(spec: str):
    """``"cuda:90"`` or ``"hip:gfx942"`` → a Triton ``GPUTarget``."""
    from triton.backends.compiler import GPUTarget

    backend, _, arch = spec.partition(":")
    if backend == "cuda" and arch.isdigit():
        return GPUTarget("cuda", int(arch), 32)
    if backend == "hip" and arch.startswith("gfx"):
        return GPUTarget("hip", arch, 64)
    raise ValueError(f"target must look like 'cuda:90' or 'hip:gfx942', got {spec!r}")


class _TargetDriver:
    """The few driver queries a launch makes before compiling, answered for a GPU that is not here."""

    def __init__(self, target) -> None:
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


@contextlib.contextmanager
def compile_only(target: str = "cuda:90") -> Iterator[Record]:
    """Within the block every Triton launch compiles for ``target`` and returns without running."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_only needs TRITON_INTERPRET unset before the kernels are imported")
    from triton.runtime import driver
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    record = Record(target)
    jit_run, tune_run, previous = JITFunction.run, Autotuner.run, driver._active

    def run(self, *args, grid, warmup, **kwargs):
        kernel = jit_run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel is not None:
            md = kernel.metadata
            record.compiled.append(Compiled(f"{self.fn.__module__}.{self.fn.__name__}", target,
                                            int(md.shared), int(md.num_warps)))
        return kernel

    def tune(self, *args, **kwargs):
        # Every config that survives pruning would be benchmarked on a GPU: compile each of them.
        self.nargs = dict(zip(self.arg_names, args))
        try:
            for config in self.prune_configs(kwargs):
                kernel = self.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            self.nargs = None
        return kernel

    from apex._backend import compile_only_mode

    driver.set_active(_TargetDriver(parse_target(target)))
    JITFunction.run, Autotuner.run = run, tune
    try:
        with compile_only_mode():
            yield record
    finally:
        JITFunction.run, Autotuner.run = jit_run, tune_run
        driver._active = previous


def launched_kernels() -> set[str]:
    """Every ``module.kernel`` that a launcher in ``apex._kernels`` launches (``kernel[grid](...)``)."""
    from triton.runtime.jit import KernelInterface

    import apex._kernels as pkg

    found = set()
    for info in pkgutil.iter_modules(pkg.__path__):
        name = f"{pkg.__name__}.{info.name}"
        module = importlib.import_module(name)
        for node in ast.walk(ast.parse(module.__loader__.get_source(name))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value
                attr = target.id if isinstance(target, ast.Name) else getattr(target, "attr", None)
                kernel = getattr(module, attr, None) if attr else None
                if isinstance(kernel, KernelInterface):  # a launcher's parameter named `kernel` is not one
                    fn = kernel
                    while hasattr(fn, "fn"):
                        fn = fn.fn
                    found.add(f"{fn.__module__}.{fn.__name__}")
    return found


_SINGLE_PROCESS = ("benchmarks.ops.", "benchmarks.optimizers.", "benchmarks.amp.")


def _benchmark_calls():
    """(case name, callable) for every benchmark case's Triton-path calls: the counted and the timed sizes
    (timed only for the single-process packages: the multi-rank cases spawn processes of their own)."""
    from benchmarks.run import discover

    for _, case in discover():
        if case.counted is not None:
            yield case.name, lambda case=case: case.counted().triton()
        if case.timed is not None and getattr(case.timed, "__module__", "").startswith(_SINGLE_PROCESS):
            yield case.name + " (timed size)", lambda case=case: case.timed()[0]()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", action="append", help="cuda:90 (default), cuda:80, hip:gfx942, ...")
    p.add_argument("-k", default="", help="only benchmark cases whose name contains this text")
    p.add_argument("--no-timed", action="store_true", help="compile the counted sizes only")
    args = p.parse_args(argv)
    os.environ["APEX_BACKEND"] = "triton"  # CPU tensors take the Triton path; launches only compile
    failures, missing = [], set()
    for target in args.target or ["cuda:90"]:
        with compile_only(target) as rec:
            for name, call in _benchmark_calls():
                if args.k not in name or (args.no_timed and name.endswith("(timed size)")):
                    continue
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - report every failing case, not only the first
                    failures.append(f"{target} {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        limit = SHARED_LIMIT.get(target)
        for c in rec.compiled:
            if limit is not None and c.shared > limit:
                failures.append(f"{target} {c.kernel}: {c.shared} bytes of shared memory > {limit}")
        if not args.k:
            missing |= {f"{target} {k}" for k in launched_kernels() - rec.kernels()}
        print(f"{target}: {len(rec.compiled)} specialisations of {len(rec.kernels())} kernels compiled; "
              f"largest shared memory {max((c.shared for c in rec.compiled), default=0)} bytes")
    for line in failures:
        print("FAILED", line)
    for line in sorted(missing):
        print("NOT COMPILED (no benchmark case launches it)", line)
    return 1 if failures or missing else 0


if __name__ == "__main__":
    sys.exit(main())
