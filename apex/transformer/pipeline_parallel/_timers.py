"""Wall-clock timers for pipeline steps (Megatron's ``_Timers``); synchronize CUDA only when it is in use."""

from __future__ import annotations

import time

import torch

from apex._errors import AssertRuntimeError, AssertValueError


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class _Timer:
    def __init__(self, name: str) -> None:
        self.name_ = name
        self.elapsed_ = 0.0
        self.started_ = False
        self.start_time = time.time()

    def start(self) -> None:
        if self.started_:
            raise AssertRuntimeError(f"timer {self.name_!r} has already been started")
        _sync()
        self.start_time = time.time()
        self.started_ = True

    def stop(self) -> None:
        if not self.started_:
            raise AssertRuntimeError(f"timer {self.name_!r} is not started")
        _sync()
        self.elapsed_ += time.time() - self.start_time
        self.started_ = False

    def reset(self) -> None:
        self.elapsed_ = 0.0
        self.started_ = False

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (a running timer is included and keeps running)."""
        running = self.started_
        if running:
            self.stop()
        value = self.elapsed_
        if reset:
            self.reset()
        if running:
            self.start()
        return value


class _Timers:
    """Named timers created on first use: ``timers("forward").start()``."""

    def __init__(self) -> None:
        self.timers: dict = {}

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name)
        return self.timers[name]

    def write(self, names, writer, iteration, normalizer: float = 1.0, reset: bool = False) -> None:
        if normalizer <= 0.0:
            raise AssertValueError(f"normalizer must be > 0, got {normalizer}")
        for name in names:
            writer.add_scalar(name + "-time", self.timers[name].elapsed(reset=reset) / normalizer, iteration)

    def log(self, names, normalizer: float = 1.0, reset: bool = True) -> None:
        if normalizer <= 0.0:
            raise AssertValueError(f"normalizer must be > 0, got {normalizer}")
        string = "time (ms)"
        for name in names:
            string += f" | {name}: {self.timers[name].elapsed(reset=reset) * 1000.0 / normalizer:.2f}"
        dist = torch.distributed
        if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
            print(string, flush=True)
