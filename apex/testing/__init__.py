"""Helpers for apex's tests and benchmarks: float64 references, tolerances, the relative-error check,
a Gloo spawn helper and the Triton-interpreter tracer. Only tests and benchmarks import this package."""

from apex.testing.distributed import run_distributed
from apex.testing.numerics import (
    DTYPES,
    TOLERANCES,
    assert_rel_close,
    inject_nonfinite,
    rand,
    rel_error,
    to_float64,
)
from apex.testing.triton_trace import (
    TritonTrace,
    count_eager,
    fp32_scalar_arguments,
    prepare_interpreter,
    round_bf16_to_nearest_even,
    speed_up_interpreter,
    wide_scalar_arguments,
)

__all__ = [
    "DTYPES",
    "TOLERANCES",
    "TritonTrace",
    "assert_rel_close",
    "count_eager",
    "fp32_scalar_arguments",
    "inject_nonfinite",
    "rand",
    "rel_error",
    "prepare_interpreter",
    "round_bf16_to_nearest_even",
    "run_distributed",
    "speed_up_interpreter",
    "to_float64",
    "wide_scalar_arguments",
]
