"""Megatron's global variables (arguments, timers, the microbatch calculator) for the standalone models
and tests, held by one :class:`_Globals` object."""

from __future__ import annotations

import time

import torch

from apex.transformer.pipeline_parallel.utils import _ensure_var_is_initialized, _ensure_var_is_not_initialized
from apex.transformer.testing.arguments import parse_args


class _Globals:
    def __init__(self) -> None:
        self.args = None
        self.num_microbatches_calculator = None
        self.tokenizer = None
        self.tensorboard_writer = None
        self.adlr_autoresume = None
        self.timers = None


_GLOBALS = _Globals()


def get_args():
    """The parsed test arguments; ``RuntimeError`` before ``set_global_variables``."""
    _ensure_var_is_initialized(_GLOBALS.args, "args")
    return _GLOBALS.args


def get_num_microbatches() -> int:
    """The number of microbatches of the test's microbatch calculator."""
    return _GLOBALS.num_microbatches_calculator.get()


def get_current_global_batch_size() -> int:
    """The current global batch size of the test's microbatch calculator."""
    return _GLOBALS.num_microbatches_calculator.get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, *, consistency_check: bool = True) -> None:
    """Advance the test's microbatch calculator to ``consumed_samples``."""
    _GLOBALS.num_microbatches_calculator.update(consumed_samples, consistency_check)


def get_tensorboard_writer():
    """The TensorBoard writer, or None."""
    return _GLOBALS.tensorboard_writer


def get_adlr_autoresume():
    """ADLR autoresume, or None."""
    return _GLOBALS.adlr_autoresume


def get_timers():
    """The test's timers; ``RuntimeError`` before ``set_global_variables``."""
    _ensure_var_is_initialized(_GLOBALS.timers, "timers")
    return _GLOBALS.timers


def set_global_variables(extra_args_provider=None, args_defaults={}, override_args={},  # noqa: B006
                         ignore_unknown_args=False):
    """Parse the arguments (once) and create the timers."""
    _ensure_var_is_not_initialized(_GLOBALS.args, "args")
    _GLOBALS.args = parse_args(extra_args_provider=extra_args_provider, defaults=args_defaults,
                               override_args=override_args, ignore_unknown_args=ignore_unknown_args)
    _GLOBALS.timers = Timers()


def set_args(args) -> None:
    """Install ``args`` (an ``argparse.Namespace``) as the global arguments, replacing any."""
    _GLOBALS.args = args


def reset_global_variables() -> None:
    """Forget every global (tests run several configurations in one process)."""
    _GLOBALS.__init__()


def _build_num_microbatches_calculator(args):
    from apex.transformer.microbatches import build_num_microbatches_calculator  # part of the pipeline layer

    _ensure_var_is_not_initialized(_GLOBALS.num_microbatches_calculator, "num microbatches calculator")
    _GLOBALS.num_microbatches_calculator = build_num_microbatches_calculator(args)


class _Timer:
    def __init__(self, name: str):
        self.name_ = name
        self.elapsed_ = 0.0
        self.started_ = False
        self.start_time = time.time()

    def _sync(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def start(self):
        if self.started_:
            raise RuntimeError("timer has already been started")
        self._sync()
        self.start_time = time.time()
        self.started_ = True

    def stop(self):
        if not self.started_:
            raise RuntimeError("timer is not started")
        self._sync()
        self.elapsed_ += time.time() - self.start_time
        self.started_ = False

    def reset(self):
        self.elapsed_ = 0.0
        self.started_ = False

    def elapsed(self, reset=True):
        started = self.started_
        if started:
            self.stop()
        elapsed = self.elapsed_
        if reset:
            self.reset()
        if started:
            self.start()
        return elapsed


class Timers:
    """Group of named timers."""

    def __init__(self):
        self.timers = {}

    def __call__(self, name):
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def write(self, names, writer, iteration, normalizer=1.0, reset=False):
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        for name in names:
            writer.add_scalar(name + "-time", self.timers[name].elapsed(reset=reset) / normalizer, iteration)

    def log(self, names, normalizer=1.0, reset=True):
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        string = "time (ms)"
        for name in names:
            string += f" | {name}: {self.timers[name].elapsed(reset=reset) * 1000.0 / normalizer:.2f}"
        if not torch.distributed.is_initialized() or \
                torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            print(string, flush=True)
