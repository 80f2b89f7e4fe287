"""The test suite's device switch: ``APEX_TEST_DEVICE=cuda`` runs every Triton-path test compiled on a GPU.

By default (``APEX_TEST_DEVICE`` unset or ``cpu``) the Triton kernels run on CPU tensors under the Triton
interpreter. With ``APEX_TEST_DEVICE=cuda`` the interpreter stays off, and while a test runs on the Triton
path (the ``backend_name`` fixture's ``"triton"`` case) tensors the test creates without naming a device
are created as on the CPU -- same values, same generators -- and moved to the GPU
(:class:`apex.testing.device.OnDevice`),
so the kernels are compiled and launched on the GPU. The PyTorch-path case stays on the CPU. Without a CUDA
device those cases are skipped, with the reason.

The interpreter's memory tracer cannot watch a compiled kernel: under the switch ``apex.testing.TritonTrace``
becomes :class:`LaunchCounter`, which counts launches and kernels the same way (a launch is one
``kernel[grid](...)``; an autotuned kernel's benchmarking runs are not counted) and skips the rest of a test
that asks for byte counts. Autotuned kernels keep two of their configs there (:func:`cap_autotuning`).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch

from apex.testing.device import OnDevice  # noqa: F401  (re-exported for conftest)

VALUES = ("cpu", "cuda")


def requested() -> str:
    value = os.environ.get("APEX_TEST_DEVICE", "cpu").strip().lower() or "cpu"
    if value not in VALUES:
        raise pytest.UsageError(f"APEX_TEST_DEVICE must be one of {VALUES}, got {value!r}")
    return value


def triton_device() -> tuple[torch.device | None, str]:
    """Where the Triton-path cases run: ``(device, "")``, or ``(None, reason)`` to skip them."""
    if requested() == "cpu":
        return torch.device("cpu"), ""
    if not torch.cuda.is_available():
        return None, "APEX_TEST_DEVICE=cuda, but no CUDA device is visible (torch.cuda.is_available() is False)"
    return torch.device("cuda", torch.cuda.current_device()), ""


class LaunchCounter:
    """``TritonTrace``'s interface for compiled kernels: ``launches`` and ``kernels`` are counted;
    ``watch`` does nothing (there are no addresses to check); byte counts skip the test from that point."""

    def __init__(self, bounds: bool = True, count: bool = True):
        self.launches = 0
        self.kernels: Counter = Counter()
        self._saved: dict = {}
        self._inside_autotuner = 0

    def watch(self, *tensors) -> LaunchCounter:
        return self

    @property
    def bytes_requested(self) -> int:
        pytest.skip("byte counts need the Triton interpreter (APEX_TEST_DEVICE=cpu); the checks before "
                    "this point passed on the GPU")

    bytes_unique = bytes_requested

    def __enter__(self) -> LaunchCounter:
        from triton.runtime import autotuner, jit

        saved = self._saved = {"jit": jit.JITFunction.run, "auto": autotuner.Autotuner.run}
        counter = self

        def jit_run(fn, *args, warmup=False, **kwargs):
            if not warmup and not counter._inside_autotuner:
                counter.launches += 1
                counter.kernels[fn.__name__] += 1
            return saved["jit"](fn, *args, warmup=warmup, **kwargs)

        def auto_run(tuner, *args, **kwargs):
            counter.launches += 1
            counter.kernels[getattr(tuner.fn, "__name__", "autotuned")] += 1
            counter._inside_autotuner += 1
            try:
                return saved["auto"](tuner, *args, **kwargs)
            finally:
                counter._inside_autotuner -= 1

        jit.JITFunction.run = jit_run
        autotuner.Autotuner.run = auto_run
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import autotuner, jit

        jit.JITFunction.run = self._saved["jit"]
        autotuner.Autotuner.run = self._saved["auto"]


def cap_autotuning() -> None:
    """Under ``APEX_TEST_DEVICE=cuda``: each ``triton.autotune`` kernel keeps at most
    ``APEX_TEST_AUTOTUNE_CONFIGS`` of its configs (default 2, spread over its list; ``0`` keeps all).

    OpenFold's LayerNorm kernels hold 24 configs each, and the autotuner compiles and times every one for
    each new ``(M, N)``: over the tests' many shapes that took minutes. With two configs a test still
    autotunes on the GPU (a timed choice, a cache to save and load) in a second or two.
    """
    value = os.environ.get("APEX_TEST_AUTOTUNE_CONFIGS", "").strip() or "2"
    if not value.isdigit():
        raise pytest.UsageError(f"APEX_TEST_AUTOTUNE_CONFIGS must be a whole number (0: all configs), got {value!r}")
    limit = int(value)
    if limit == 0:
        return
    from apex.contrib.openfold_triton._tuning import KERNELS  # the registry of the autotuned kernels

    for fn in KERNELS.get().values():
        configs = list(fn.configs)
        if len(configs) > limit:
            picks = sorted({round(i * (len(configs) - 1) / max(limit - 1, 1)) for i in range(limit)})
            fn.configs = [configs[i] for i in picks]
