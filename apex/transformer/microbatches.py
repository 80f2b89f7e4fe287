"""Megatron's number-of-microbatches calculators (constant and batch-size ramp-up).

``num_microbatches = current_global_batch_size // (micro_batch_size * data_parallel_size)``. With a ramp-up
``[start, increment, rampup_samples]`` the global batch grows from ``start`` by ``increment`` every
``rampup_samples / ((global - start) / increment)`` consumed samples, and is ``global`` after the ramp-up.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from apex._errors import MicroBatchConfigError
from apex.transformer.log_util import get_transformer_logger

_logger = get_transformer_logger(__name__)


__all__ = [
    "NumMicroBatchesCalculator",
    "ConstantNumMicroBatches",
    "RampupBatchsizeNumMicroBatches",
    "build_num_microbatches_calculator",
]


def _positive_int(value, name: str, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 0 or (value == 0 and not allow_zero):
        raise MicroBatchConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value}")
    return value


def build_num_microbatches_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> NumMicroBatchesCalculator:
    """Constant calculator when ``rampup_batch_size`` is None, else a ramp-up one (rank 0 logs the choice)."""
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatches(global_batch_size, micro_batch_size, data_parallel_size)
        if rank == 0:
            _logger.info(f"setting number of micro-batches to constant {calculator.get()}")
        return calculator
    if len(rampup_batch_size) != 3:
        raise MicroBatchConfigError(
            "rampup_batch_size must be [start batch size, batch size increment, ramp-up samples], "
            f"got {list(rampup_batch_size)}"
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    if rank == 0:
        _logger.info(
            f"will use batch size rampup starting from global batch size {start} to global batch size "
            f"{global_batch_size} with batch size increments {increment} over {samples} samples."
        )
    return RampupBatchsizeNumMicroBatches(
        start, increment, samples, global_batch_size, micro_batch_size, data_parallel_size
    )


class NumMicroBatchesCalculator(ABC):
    def __init__(self) -> None:
        self.num_micro_batches: int | None = None
        self.current_global_batch_size: int | None = None

    def get(self) -> int:
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        return self.current_global_batch_size

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool) -> None: ...


class ConstantNumMicroBatches(NumMicroBatchesCalculator):
    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> None:
        super().__init__()
        _positive_int(global_batch_size, "global_batch_size")
        _positive_int(micro_batch_size, "micro_batch_size")
        _positive_int(data_parallel_size, "data_parallel_size")
        per_step = micro_batch_size * data_parallel_size
        if global_batch_size % per_step != 0:
            raise MicroBatchConfigError(
                f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                f"({micro_batch_size}) times data parallel size ({data_parallel_size})"
            )
        self.num_micro_batches = global_batch_size // per_step
        self.current_global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        pass


class RampupBatchsizeNumMicroBatches(NumMicroBatchesCalculator):
    """Global batch ``start + steps * increment`` with ``steps = int(consumed / (ramup_samples / increments))``."""

    def __init__(
        self,
        start_batch_size: int,
        batch_size_increment: int,
        ramup_samples: int,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
    ) -> None:
        super().__init__()
        _positive_int(start_batch_size, "start_batch_size")
        _positive_int(batch_size_increment, "batch_size_increment")
        _positive_int(ramup_samples, "ramup_samples", allow_zero=True)
        _positive_int(global_batch_size, "global_batch_size")
        _positive_int(micro_batch_size, "micro_batch_size")
        _positive_int(data_parallel_size, "data_parallel_size")
        diff = global_batch_size - start_batch_size
        if diff < 0:
            raise MicroBatchConfigError(
                f"start_batch_size ({start_batch_size}) must not exceed global_batch_size ({global_batch_size})"
            )
        if diff % batch_size_increment != 0:
            raise MicroBatchConfigError(
                f"expected global batch size interval ({diff}) to be divisible by global batch size "
                f"increment ({batch_size_increment})"
            )
        num_increments = diff // batch_size_increment
        if num_increments == 0:
            raise MicroBatchConfigError(
                f"start_batch_size equals global_batch_size ({global_batch_size}): there is nothing to ramp up; "
                "pass rampup_batch_size=None"
            )
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.start_batch_size = start_batch_size
        self.global_batch_size = global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.rampup_samples_per_increment = ramup_samples / num_increments
        self.update(0, False)

    def update(self, consumed_samples: int, consistency_check: bool) -> None:
        if consumed_samples > self.ramup_samples:
            current = self.global_batch_size
        else:
            per_increment = self.rampup_samples_per_increment
            steps = int(consumed_samples / per_increment) if per_increment else 0
            current = min(self.start_batch_size + steps * self.batch_size_increment, self.global_batch_size)
        if consistency_check and current % self.micro_batch_times_data_parallel_size != 0:
            raise MicroBatchConfigError(
                f"current global batch size ({current}) is not divisible by micro-batch-size "
                f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})"
            )
        self.current_global_batch_size = current
        self.num_micro_batches = current // self.micro_batch_times_data_parallel_size
