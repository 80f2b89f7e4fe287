"""Triton launches replaced by no-ops, so that a timing measures the host's work alone.

Inside :func:`stubbed_launches` a ``kernel[grid](...)`` call does everything up to the launch itself (the
launcher's own Python: allocations, configuration, grid, argument list) and then returns at once, compiled
(``JITFunction.run``) or under the interpreter (``InterpretedFunction.run``). The outputs stay as
``torch.empty`` left them: time with it, check values without it. ``Stub.launches`` and ``Stub.kernels``
count what was skipped, so a table can show how many launches a call makes. Both host-cost suites use it
(``bench_op_host.py``, ``bench_optimizer_host.py``).
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
def stubbed_launches(torch_fused_adam: bool = False) -> Iterator[Stub]:
    """Within the block every Triton launch is counted and skipped; with ``torch_fused_adam``, PyTorch's
    ``torch._fused_adamw_`` / ``torch._fused_adam_`` (the kernels of ``AdamW(fused=True)``) return at once
    too, so that PyTorch's optimizer step is timed the same way."""
    import torch
    from triton.runtime import interpreter, jit

    stub = Stub()
    # The interpreter's launch: InterpretedFunction.run (Triton 3.5 and newer); in Triton 3.4 ``kernel[grid]``
    # is a GridExecutor (whose ``fn`` is the kernel's function) and ``run`` an attribute of each kernel.
    interpreted = ((interpreter.InterpretedFunction, "run") if "run" in vars(interpreter.InterpretedFunction)
                   else (interpreter.GridExecutor, "__call__"))
    saved = [(jit.JITFunction, "run", jit.JITFunction.run), (*interpreted, getattr(*interpreted))]
    saved_torch = torch._fused_adamw_, torch._fused_adam_

    def run(fn, *args, grid=None, warmup=False, **kwargs):
        if not warmup:
            stub.launches += 1
            stub.kernels[getattr(getattr(fn, "fn", fn), "__name__", "kernel")] += 1

    def nothing(*args, **kwargs):
        return None

    for owner, name, _ in saved:
        setattr(owner, name, run)
    if torch_fused_adam:
        torch._fused_adamw_ = torch._fused_adam_ = nothing
    try:
        yield stub
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
        torch._fused_adamw_, torch._fused_adam_ = saved_torch
