"""Run code written for CPU tensors on a GPU, and time and rate it there (tests and benchmarks only).

:class:`OnDevice` moves the tensors a block creates without naming a device onto a device, so the test and
benchmark cases written for CPU tensors run on a GPU unchanged. :func:`cuda_time_pair` times two callables
with CUDA events, interleaved. :func:`peak_bandwidth` gives the device's memory bandwidth from its data
sheet (by name) and :func:`copy_bandwidth` measures a device-to-device copy.
"""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

# Factory functions whose result lands on the default device when no device is named.
_FACTORIES = {torch.randn, torch.rand, torch.randint, torch.randperm, torch.zeros, torch.ones, torch.empty,
              torch.full, torch.tensor, torch.arange, torch.linspace, torch.eye, torch.empty_strided}


class OnDevice(TorchFunctionMode):
    """Tensors made by a factory without a ``device`` are made on the CPU, then moved to ``device``.

    Unlike ``torch.set_default_device`` this keeps CPU generators working (``torch.randn(n, generator=g)``)
    and gives the GPU the CPU's values. ``requires_grad=True`` is applied after the move, so the tensor is
    still a leaf. Calls made by apex's operation code (``apex/ops``, ``apex/_kernels``) are left alone: a
    tensor an op deliberately builds on the host (a pointer table, say) stays there, so the GPU run tests
    the ops as users run them. Modules' parameters (``FusedLayerNorm(...)``) are moved, as a test written
    for the CPU would otherwise need ``.cuda()``.
    """

    def __init__(self, device: torch.device | str):
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if (func not in _FACTORIES or kwargs.get("device") is not None or "out" in kwargs
                or _called_from_library(sys._getframe(1).f_code.co_filename)):
            return func(*args, **kwargs)
        kwargs.pop("device", None)
        requires_grad = kwargs.pop("requires_grad", False)
        out = func(*args, **kwargs).to(self.device)
        return out.requires_grad_() if requires_grad else out


_APEX = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OP_CODE = tuple(os.path.join(_APEX, d) + os.sep for d in ("ops", "_kernels"))


def _called_from_library(filename: str) -> bool:
    return filename.startswith(_OP_CODE)


def cuda_time_pair(ours: Callable[[], object], theirs: Callable[[], object], repeats: int = 20,
                   warmup: int = 3) -> tuple[float, float]:
    """Median milliseconds of each on the current CUDA stream (CUDA events), interleaved, order alternating."""
    for _ in range(warmup):
        ours()
        theirs()
    torch.cuda.synchronize()
    fns = (ours, theirs)
    samples: dict[int, list[float]] = {0: [], 1: []}
    for i in range(repeats):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[which]()
            end.record()
            end.synchronize()
            samples[which].append(start.elapsed_time(end))
    return statistics.median(samples[0]), statistics.median(samples[1])


def cuda_time(fn: Callable[[], object], repeats: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of ``fn`` on the current CUDA stream."""
    return cuda_time_pair(fn, lambda: None, repeats, warmup)[0]


# Data-sheet memory bandwidth in GB/s (10^9 B/s), matched against torch.cuda.get_device_name, first match wins.
PEAK_GBPS = [
    ("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("H800", 3350), ("GH200", 4000),
    ("B200", 8000), ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555), ("A800", 2039),
    ("A10G", 600), ("A10", 600), ("A30", 933), ("A40", 696), ("L40S", 864), ("L40", 864), ("L4", 300),
    ("V100", 900), ("T4", 320), ("RTX 4090", 1008), ("RTX 3090", 936), ("MI300X", 5300), ("MI250X", 3277),
    ("MI250", 3277), ("MI210", 1638),
]


def peak_bandwidth(name: str) -> float | None:
    """Data-sheet memory bandwidth (GB/s) of a device named ``name``, or ``None`` when unknown."""
    for key, gbps in PEAK_GBPS:
        if key.lower() in name.lower():
            return float(gbps)
    return None


def copy_bandwidth(device: torch.device | str = "cuda", nbytes: int = 1 << 30) -> float:
    """Measured GB/s of a device-to-device copy (read + write counted), median of 5."""
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), repeats=5, warmup=2)
    return 2 * n * 4 / (ms * 1e-3) / 1e9
