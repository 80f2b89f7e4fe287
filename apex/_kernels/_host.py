"""Launchers' host-side helpers: ``triton.cdiv`` and ``triton.next_power_of_2`` as plain integer arithmetic,
and whether a kernel runs in the interpreter.

In recent Triton releases (3.9, say) both are ``constexpr_function`` objects: a call from Python unwraps
its arguments through ``triton.language`` and costs about a microsecond or more, several times per launch,
where the arithmetic costs a few dozen nanoseconds. These give the same results for the integers launchers
pass (sizes, counts).
"""

from __future__ import annotations


def cdiv(x: int, y: int) -> int:
    return (x + (y - 1)) // y


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 ≥ ``n`` (0 for 0, as Triton's)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpreted(kernel: object) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` function) runs in Triton's interpreter.

    ``triton.jit`` makes that choice when it decorates the kernel, from ``TRITON_INTERPRET`` at that moment,
    so it is a constant of the kernel: a launcher asks once, when its module is imported, instead of reading
    the environment at every launch (~1 µs), and its configuration always matches the kernel it launches
    even if the variable changes afterwards."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
