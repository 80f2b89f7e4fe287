"""Triton launches replaced by no-ops, so that a timing measures the host's work alone.

Inside :func:`stubbed_launches` a ``kernel[grid](...)`` call does everything up to the launch itself (the
launcher's own Python: allocations, configuration, grid, argument list) and then returns at once, compiled
(``JITFunction.run``) or under the interpreter (``InterpretedFunction.run``). The outputs stay as
``torch.empty`` left them: time with it, check values without it. ``Stub.launches`` and ``Stub.kernels``
count what was skipped, so a table can show how many launches a call makes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Stub:
    launches: int = 0
    kernels: Counter = field(default_factory=Counter)


@contextlib.contextmanager
def stubbed_launches() -> Iterator[Stub]:
    """Within the block every Triton launch is counted and skipped."""
    from triton.runtime import interpreter, jit

    stub = Stub()
    saved = jit.JITFunction.run, interpreter.InterpretedFunction.run

    def run(fn, *args, grid=None, warmup=False, **kwargs):
        if not warmup:
            stub.launches += 1
            stub.kernels[getattr(fn, "__name__", "kernel")] += 1

    jit.JITFunction.run = run
    interpreter.InterpretedFunction.run = run
    try:
        yield stub
    finally:
        jit.JITFunction.run, interpreter.InterpretedFunction.run = saved
