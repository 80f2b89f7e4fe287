"""Exception classes that are both this package's type and the type NVIDIA Apex raised.

The rule: an error names the bad argument and is a ``ValueError`` (a bad value) or ``TypeError`` (a bad
type), or a ``RuntimeError`` for misuse of state; where Apex signalled the same condition with ``assert`` or
``raise RuntimeError``, the class raised is *also* ``AssertionError`` / ``RuntimeError``, so that both
``except ValueError`` and the ``except AssertionError`` written against Apex (and Apex's own tests) catch
it. Each class below says which pair it stands for; a new error path picks the class whose pair it needs.

This module imports nothing from apex, so every layer may import it. The classes are internal: client code
catches the builtin types, and the public names built on them (``ParallelStateError``,
``MicroBatchConfigError``) keep the modules they have always been imported from.
"""

from __future__ import annotations

__all__ = [
    "AssertRuntimeError",
    "AssertTypeError",
    "AssertValueError",
    "MicroBatchConfigError",
    "ParallelStateError",
    "RuntimeTypeError",
    "RuntimeValueError",
]


class AssertValueError(ValueError, AssertionError):
    """A bad argument value where Apex had an ``assert`` (``ValueError`` here, ``AssertionError`` there)."""


class AssertTypeError(TypeError, AssertionError):
    """An argument of the wrong type or dtype where Apex had an ``assert`` (``TypeError`` /
    ``AssertionError``)."""


class AssertRuntimeError(RuntimeError, AssertionError):
    """Misuse of state (initialised twice, used before set-up, a buffer exhausted) where Apex had an
    ``assert`` (``RuntimeError`` / ``AssertionError``)."""


class RuntimeValueError(ValueError, RuntimeError):
    """A bad argument value where Apex raised ``RuntimeError`` (``ValueError`` / ``RuntimeError``)."""


class RuntimeTypeError(TypeError, RuntimeError):
    """An argument of the wrong type where Apex raised ``RuntimeError`` (``TypeError`` / ``RuntimeError``)."""


class ParallelStateError(RuntimeError, AssertionError):
    """Misuse of the model-parallel state (a getter before initialization, initializing twice).

    A ``RuntimeError`` that is also an ``AssertionError``, because Apex asserted these conditions."""


class MicroBatchConfigError(ValueError, AssertionError):
    """Bad batch-size configuration: a ``ValueError`` that is also an ``AssertionError``, because Apex asserted
    these conditions."""


# Public classes with builtin bases only, so that their reference page shows the two types to catch.
# Tracebacks, pickles and the API reference keep naming these where clients import them from (both modules
# import the classes from here).
ParallelStateError.__module__ = "apex.transformer.parallel_state"
MicroBatchConfigError.__module__ = "apex.transformer.microbatches"
