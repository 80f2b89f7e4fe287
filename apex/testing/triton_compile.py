"""Compile apex's Triton kernels for GPUs that are not on this machine.

The interpreter runs kernels with NumPy semantics, so it misses what only the compiler sees: type
promotion, constexpr misuse, unsupported ops, shared memory beyond what the target has. Compiling needs no
GPU. :func:`compile_only` turns every kernel launch into an ahead-of-time compile for a named target while
the launchers run on CPU tensors (their outputs stay uninitialised: run code for its launches, not its
results), and records what was compiled.

:func:`check` runs the calls it is given -- ``(name, zero-argument callable)`` pairs that launch kernels --
under :func:`compile_only` for each target and checks that each kernel launched in ``apex/_kernels`` was
compiled, with its shared memory within the target's limit. The calls come from the caller: the repository's
``benchmarks/compile_kernels.py`` passes every benchmark case's Triton path (this installed package does not
reach into the repository's ``benchmarks/``)::

    python benchmarks/compile_kernels.py --target cuda:90 --target hip:gfx942
    python -m apex.testing.triton_compile --calls mypackage.module:function --target cuda:90

It must run in a process where ``TRITON_INTERPRET`` is unset before any kernel module is imported.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
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
    # (the active driver: ``driver._active`` since Triton 3.5, a plain ``active`` attribute in 3.4)
    active = "_active" if hasattr(driver, "_active") else "active"
    jit_run, tune_run, previous = JITFunction.run, Autotuner.run, getattr(driver, active)

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
        setattr(driver, active, previous)


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


Calls = Callable[[], Iterable[tuple[str, Callable[[], object]]]]


def check(calls: Calls, targets: Sequence[str] = ("cuda:90",), select: str = "",
          require_all: bool | None = None) -> int:
    """Compile every launch of ``calls()`` (``(name, fn)`` pairs; those whose name contains ``select``) for
    each target; print what compiled and every failure. A failure: a call that raised, a kernel over the
    target's shared memory, and (``require_all``, by default when nothing is deselected) a kernel launched
    in ``apex/_kernels`` that no call compiled. Returns 1 on any failure, else 0."""
    from apex._backend import backend

    require_all = not select if require_all is None else require_all
    failures, missing = [], set()
    for target in targets:
        # CPU tensors take the Triton path; launches only compile.
        with compile_only(target) as rec, backend("triton"):
            for name, call in calls():
                if select not in name:
                    continue
                try:
                    call()
                except Exception as e:  # noqa: BLE001 - report every failing case, not only the first
                    failures.append(f"{target} {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        limit = SHARED_LIMIT.get(target)
        for c in rec.compiled:
            if limit is not None and c.shared > limit:
                failures.append(f"{target} {c.kernel}: {c.shared} bytes of shared memory > {limit}")
        if require_all:
            missing |= {f"{target} {k}" for k in launched_kernels() - rec.kernels()}
        print(f"{target}: {len(rec.compiled)} specialisations of {len(rec.kernels())} kernels compiled; "
              f"largest shared memory {max((c.shared for c in rec.compiled), default=0)} bytes")
    for line in failures:
        print("FAILED", line)
    for line in sorted(missing):
        print("NOT COMPILED (no call launches it)", line)
    return 1 if failures or missing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", required=True, metavar="MODULE:FUNCTION",
                   help="a function returning (name, callable) pairs whose launches are compiled")
    p.add_argument("--target", action="append", help="cuda:90 (default), cuda:80, hip:gfx942, ...")
    p.add_argument("-k", default="", help="only calls whose name contains this text")
    args = p.parse_args(argv)
    module, _, attr = args.calls.partition(":")
    if not attr:
        p.error(f"--calls must look like MODULE:FUNCTION, got {args.calls!r}")
    calls = getattr(importlib.import_module(module), attr)
    return check(calls, args.target or ["cuda:90"], args.k)


if __name__ == "__main__":
    sys.exit(main())
