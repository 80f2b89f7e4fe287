"""Does a device compute in bf16/fp16 at full speed? One answer for amp, the examples and ``python -m apex``.

A half type only pays off where the hardware multiplies in it. On CPUs that means AVX512-BF16 or AMX
(x86) or the BF16/FP16 extensions (Arm); elsewhere PyTorch's CPU kernels emulate bf16 and fp16, and a bf16
matmul has been measured at 30-85x the time of the fp32 one on an AVX2-only AMD EPYC. On CUDA GPUs fp16 runs
on tensor cores from compute capability 7.0 (Volta) and bf16 from 8.0 (Ampere); ROCm GPUs that PyTorch
supports have both.

Every answer comes from PyTorch's own capability queries (``torch.cpu._is_avx512_bf16_supported``,
``torch.cpu._is_amx_tile_supported``, ``torch.ops.mkldnn._is_mkldnn_*_supported``,
``torch.cuda.get_device_capability``), asked on first use and cached; importing this module asks nothing.
:func:`measure_slowdown` times a matmul in the half type against fp32, for warnings that state a measured
factor rather than a guess.
"""

from __future__ import annotations

import functools
import platform
import time
from dataclasses import dataclass

import torch

_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}


@dataclass(frozen=True)
class Capability:
    """What a device computes at full speed.

    ``fast`` always holds ``torch.float32``, then the half types with hardware support; ``reason`` names
    the features that decided (e.g. ``"no AVX512-BF16/AMX, no AMX-FP16 (CPU capability AVX2)"``,
    ``"compute capability 8.0"``).
    """

    device_type: str
    name: str
    fast: tuple[torch.dtype, ...]
    reason: str

    def has(self, dtype: torch.dtype) -> bool:
        return dtype in self.fast

    def summary(self) -> str:
        kinds = ", ".join(_NAMES[d] for d in self.fast)
        return f"{self.name}: fast {kinds} ({self.reason})"


def _query(fn_owner, name: str) -> bool:
    """A private PyTorch query that may be missing from some builds: missing means no."""
    fn = getattr(fn_owner, name, None)
    if fn is None:
        return False
    try:
        return bool(fn())
    except (RuntimeError, AttributeError):
        return False


def _cpu_features() -> dict[str, bool]:
    """The CPU features that decide, as PyTorch sees them (the function tests replace)."""
    mkldnn = torch.ops.mkldnn
    return {
        "avx512_bf16": _query(torch.cpu, "_is_avx512_bf16_supported"),
        "amx_tile": _query(torch.cpu, "_is_amx_tile_supported"),
        "amx_fp16": _query(torch.cpu, "_is_amx_fp16_supported"),
        "mkldnn_bf16": _query(mkldnn, "_is_mkldnn_bf16_supported"),
        "mkldnn_fp16": _query(mkldnn, "_is_mkldnn_fp16_supported"),
    }


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _cpu_capability() -> Capability:
    feats = _cpu_features()
    arm = platform.machine().lower() in ("arm64", "aarch64")
    try:
        isa = torch.backends.cpu.get_cpu_capability()
    except (RuntimeError, AttributeError):
        isa = "unknown"
    fast = [torch.float32]
    found = []
    if feats["avx512_bf16"] or feats["amx_tile"] or (arm and feats["mkldnn_bf16"]):
        fast.append(torch.bfloat16)
        found.append("AMX" if feats["amx_tile"] else "AVX512-BF16" if feats["avx512_bf16"] else "Arm BF16")
    else:
        found.append("no " + ("BF16 extension" if arm else "AVX512-BF16/AMX"))
    if feats["amx_fp16"] or (arm and feats["mkldnn_fp16"]):
        fast.append(torch.float16)
        found.append("AMX-FP16" if feats["amx_fp16"] else "Arm FP16")
    else:
        found.append("no " + ("FP16 extension" if arm else "AMX-FP16"))
    found[-1] += f" (CPU capability {isa})"
    return Capability("cpu", _cpu_name(), tuple(fast), ", ".join(found))


def _cuda_capability(index: int) -> Capability:
    name = torch.cuda.get_device_name(index)
    if getattr(torch.version, "hip", None):
        return Capability("cuda", name, (torch.float32, torch.bfloat16, torch.float16), "ROCm GPU")
    major, minor = torch.cuda.get_device_capability(index)
    fast = [torch.float32]
    if (major, minor) >= (8, 0):
        fast.append(torch.bfloat16)
    if (major, minor) >= (7, 0):
        fast.append(torch.float16)
    return Capability("cuda", name, tuple(fast), f"compute capability {major}.{minor}")


@functools.cache
def _capability(device_type: str, index: int) -> Capability:
    if device_type == "cpu":
        return _cpu_capability()
    if device_type == "cuda":
        return _cuda_capability(index)
    return Capability(device_type, device_type, (torch.float32,), "unknown device type: fp32 only assumed")


def _key(device) -> tuple[str, int]:
    if isinstance(device, torch.Tensor):
        device = device.device
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be a torch.device, a device string or a tensor, got {device!r}") from exc
    if dev.type == "cuda" and dev.index is None:
        return "cuda", torch.cuda.current_device()
    return dev.type, dev.index or 0


def capability(device: torch.device | str | torch.Tensor = "cpu") -> Capability:
    """The :class:`Capability` of ``device`` (a device, a device string, or a tensor on it)."""
    return _capability(*_key(device))


def fast_dtypes(device: torch.device | str | torch.Tensor = "cpu") -> tuple[torch.dtype, ...]:
    """The dtypes ``device`` computes at full speed: ``torch.float32`` first, then the half types."""
    return capability(device).fast


def has_fast_half(device: torch.device | str | torch.Tensor, dtype: torch.dtype) -> bool:
    """True when ``device`` has hardware for ``dtype`` (``torch.float16`` or ``torch.bfloat16``)."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    return capability(device).has(dtype)


def best_half(device: torch.device | str | torch.Tensor) -> torch.dtype | None:
    """The half type to train in on ``device``: bf16 where fast, else fp16 where fast, else ``None``
    (stay in fp32)."""
    fast = fast_dtypes(device)
    for dtype in (torch.bfloat16, torch.float16):
        if dtype in fast:
            return dtype
    return None


@dataclass(frozen=True)
class Slowdown:
    """``factor = half_ms / fp32_ms`` for one ``n x n`` matmul (on one thread, on CPUs)."""

    dtype: torch.dtype
    device_type: str
    n: int
    half_ms: float
    fp32_ms: float

    @property
    def factor(self) -> float:
        return self.half_ms / self.fp32_ms

    def describe(self) -> str:
        return (f"a {self.n}x{self.n} {_NAMES[self.dtype]} matmul measured {self.factor:.1f}x the time of fp32 "
                f"here ({self.half_ms:.2f} ms vs {self.fp32_ms:.2f} ms)")


def _best_ms(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    sync = torch.cuda.synchronize if a.device.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: first-call dispatch, kernel selection, allocation
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@functools.cache
def measure_slowdown(dtype: torch.dtype = torch.bfloat16, device_type: str = "cpu", n: int | None = None,
                     repeats: int = 3) -> Slowdown:
    """Time an ``n x n`` matmul in ``dtype`` against fp32 (best of ``repeats``), once per process.

    On CPUs one thread (so the figure does not depend on how busy the other cores are) and ``n=256`` by
    default; where ``dtype`` is emulated the cost grows with the size (about 10x at n=128 and 30-85x at
    n=256 on an AVX2 EPYC), so the figure is a lower bound for wider layers. Takes ~0.1 s where the half
    type is slow. On CUDA ``n=2048`` by default, on the current device.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype!r}")
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    n = n or (256 if device_type == "cpu" else 2048)
    threads = torch.get_num_threads()
    if device_type == "cpu":
        torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=g).to(device_type)
        b = torch.randn(n, n, generator=g).to(device_type)
        with torch.autocast(device_type, enabled=False), torch.no_grad():
            fp32 = _best_ms(a, b, repeats)
            half = _best_ms(a.to(dtype), b.to(dtype), repeats)
    finally:
        torch.set_num_threads(threads)
    return Slowdown(dtype, device_type, n, half, max(fp32, 1e-6))


def cache_clear() -> None:
    """Forget the cached answers (tests that replace the queries call it)."""
    _capability.cache_clear()
    measure_slowdown.cache_clear()
