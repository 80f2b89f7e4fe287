"""GPU-sized benchmark cases: apex against eager PyTorch, ``torch.compile`` and Liger-Kernel on one GPU.

A benchmark module may define ``gpu_cases() -> list[GpuCase]`` beside its CPU ``cases()``. A case is one
operation, one mode, one shape and one dtype:

* ``mode``: ``fwd`` (a training forward: inputs that need gradients, grad mode on), ``bwd`` (the backward of
  one such forward, ``autograd.grad(..., retain_graph=True)``), ``fwdbwd`` (both, for ops such as Liger's
  cross-entropy that compute the gradient inside the forward) or ``step`` (one optimizer step).
* ``bytes_min``: what the mode must move at least -- every input read once, every output written once --
  computed from the shape alone, so the case list can be checked without allocating anything. GB/s is
  ``bytes_min`` over the median time, whichever implementation ran; an implementation that moves more (or
  launches more kernels) shows as a lower rate.
* ``make(device)``: the inputs, the same values on every call (a seeded generator on the device), so every
  implementation gets fresh inputs of its own: some (Liger's RMSNorm backward, its cross-entropy) write
  into their inputs.
* ``impls``: label -> builder of an :class:`Impl` from the inputs; ``compiled``: the eager PyTorch function
  that ``torch.compile`` wraps (the ``torch.compile`` row); ``reference``: the outputs (``fwd``, ``step``)
  or gradients (``bwd``, ``fwdbwd``) in fp32 (fp64 for fp32 cases), against which each implementation's
  relative error ``||out - ref|| / ||ref||`` is taken (the worst of its outputs).

:func:`run_case` times every implementation with an injected ``timer`` (``triton.testing.do_bench``'s median
on a GPU; a fake one in the tests, which run this code on CPU tensors).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = (BF16, FP16)
SHORT = {BF16: "bf16", FP16: "fp16", FP32: "fp32", torch.float64: "fp64"}
MODES = ("fwd", "bwd", "fwdbwd", "step")


def liger_available() -> bool:
    """Liger-Kernel is an optional benchmark dependency (``pip install -e ".[bench]"``)."""
    return importlib.util.find_spec("liger_kernel") is not None


@dataclass
class Impl:
    """One implementation of a case, built on its own inputs.

    ``forward()`` returns the output(s); ``leaves`` are what the backward differentiates and ``dy`` its
    output gradient(s) (``None`` for a scalar loss). ``result()``, when given, returns what to check after
    one call instead (an optimizer's update). ``out_to_ref``/``grads_to_ref`` map outputs or gradients to the
    reference's layout (Liger's RoPE takes q and k in another layout)."""

    forward: Callable[[], object]
    leaves: tuple = ()
    dy: object = None
    result: Callable[[], object] | None = None
    out_to_ref: Callable[[object], object] | None = None
    grads_to_ref: Callable[[object], object] | None = None


@dataclass
class GpuCase:
    op: str
    mode: str
    shape: str
    dtype: torch.dtype
    bytes_min: int
    make: Callable[[torch.device], dict]
    impls: dict[str, Callable[[dict], Impl]]
    reference: Callable[[dict], object] | None = None
    compiled: Callable[[dict], object] | None = None  # the eager PyTorch function torch.compile wraps
    grads: tuple[str, ...] = ()
    quick: bool = False
    note: str = ""
    labels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        self.labels = list(self.impls) + (["torch.compile"] if self.compiled is not None else [])

    @property
    def name(self) -> str:
        return f"{self.op} {self.mode} {self.shape} {SHORT[self.dtype]}"


# ----------------------------------------------------------------------------- building cases
def generator(device: torch.device | str, seed: int = 0) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def randn(shape, dtype, device, g: torch.Generator, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """Normal values drawn in fp32 then rounded to ``dtype`` (the same values for bf16 and fp16 runs)."""
    return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale + shift).to(dtype)


def fn_impl(f: Callable[[dict], object], grads: Sequence[str]) -> Callable[[dict], Impl]:
    """The builder for a plain function ``f(inputs) -> outputs`` differentiated w.r.t. ``inputs[g]``."""
    def build(inputs: dict) -> Impl:
        return Impl(forward=lambda: f(inputs), leaves=tuple(inputs[g] for g in grads), dy=inputs.get("dy"))
    return build


def upcast(inputs: dict, grads: Sequence[str], dtype: torch.dtype) -> dict:
    """Floating-point tensors as ``dtype`` leaves (those in ``grads`` needing gradients); the rest as is."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            v = v.detach().to(dtype).requires_grad_(k in grads)
        out[k] = v
    return out


def function_reference(f: Callable[[dict], object], grads: Sequence[str], mode: str, dtype: torch.dtype):
    """The reference of a case whose eager function is ``f``: ``f`` on the inputs upcast to fp32 (fp64 for
    fp32 cases), and for the backward modes the gradients of that graph."""
    ref_dtype = torch.float64 if dtype == FP32 else FP32

    def reference(inputs: dict):
        up = upcast(inputs, grads, ref_dtype)
        with torch.enable_grad():
            y = f(up)
            if mode == "fwd":
                return _detach(y)
            return torch.autograd.grad(y, [up[g] for g in grads], up.get("dy"))
    return reference


def op_cases(op: str, shapes: Sequence[tuple], dtypes: Sequence[torch.dtype], modes: Sequence[str],
             make: Callable, fns: dict[str, Callable[[dict], object]],
             bytes_min: Callable[[tuple, torch.dtype, str], int], grads: Sequence[str],
             builders: dict[str, Callable[[dict], Impl]] | None = None, note: str = "") -> list[GpuCase]:
    """Cases of one operation: ``fns`` maps labels ("apex", "torch", ...) to ``f(inputs) -> outputs``;
    ``fns["torch"]`` is the eager PyTorch code, compiled for the ``torch.compile`` row and run in fp32 for the
    reference. ``builders`` adds implementations that need more than a function (Liger's). The first shape
    in bf16 is the ``--quick`` subset."""
    cases = []
    for dtype in dtypes:
        for i, shape in enumerate(shapes):
            for mode in modes:
                impls = {label: fn_impl(f, grads) for label, f in fns.items()}
                impls.update(builders or {})
                cases.append(GpuCase(
                    op, mode, "x".join(map(str, shape)), dtype, bytes_min(shape, dtype, mode),
                    make=functools.partial(make, shape, dtype), impls=impls,
                    reference=function_reference(fns["torch"], grads, mode, dtype), compiled=fns["torch"],
                    grads=tuple(grads), quick=i == 0 and dtype == BF16, note=note))
    return cases


# ----------------------------------------------------------------------------- running cases
class CaseTimeout(BaseException):
    """Raised inside a case that runs past its cap. A BaseException, so that the ``except Exception`` of
    the code under test (a compiler's fallback, say) does not swallow it."""


@contextlib.contextmanager
def time_cap(seconds: float | None):
    """Interrupt the block after ``seconds`` (SIGALRM; main thread on POSIX only, otherwise no cap), or when
    an import running then has finished."""
    if (not seconds or seconds <= 0 or not hasattr(signal, "setitimer")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def stop(signum, frame):
        # Not inside an import (a first autograd call imports sympy, a first torch.compile Inductor): a
        # module stopped half-way stays half-initialised in sys.modules and breaks every later case. Such a
        # case stops when its import is done.
        f = frame
        while f is not None:
            if f.f_code.co_filename.startswith("<frozen importlib"):
                signal.setitimer(signal.ITIMER_REAL, 0.05)
                return
            f = f.f_back
        raise CaseTimeout(f"stopped at its {seconds:.0f} s cap")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _detach(y):
    if isinstance(y, (tuple, list)):
        return type(y)(_detach(t) for t in y)
    return y.detach() if isinstance(y, torch.Tensor) else y


def _parts(y) -> list[torch.Tensor]:
    if isinstance(y, (tuple, list)):
        return [t for part in y for t in _parts(part)]
    return [y] if isinstance(y, torch.Tensor) else []


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` of each output, the worst one (norms accumulated in fp64)."""
    outs, refs = _parts(out), _parts(ref)
    if len(outs) != len(refs) or not refs:
        raise ValueError(f"{len(outs)} outputs against {len(refs)} reference tensors")
    worst = 0.0
    for o, r in zip(outs, refs):
        if tuple(o.shape) != tuple(r.shape):
            raise ValueError(f"output shape {list(o.shape)} against reference {list(r.shape)}")
        wide = torch.float64 if torch.float64 in (o.dtype, r.dtype) else torch.float32
        num = torch.linalg.vector_norm(o.detach().to(wide) - r.to(wide), dtype=torch.float64)
        den = torch.linalg.vector_norm(r, dtype=torch.float64)
        err = float(num / den) if float(den) > 0 else float(num)
        if not err <= worst:  # NaN (an output with NaN or inf) must win, not vanish in max()
            worst = err
    return worst


def compiled_impl(f: Callable[[dict], object], grads: Sequence[str], backend: str) -> Callable[[dict], Impl]:
    """``torch.compile(f)``, static shapes; the compile cache is emptied first, so the many shapes and dtypes
    of one function never reach dynamo's recompile limit (past which it silently runs eager code)."""
    def build(inputs: dict) -> Impl:
        torch._dynamo.reset()
        cf = torch.compile(f, backend=backend, dynamic=False)
        return Impl(forward=lambda: cf(inputs), leaves=tuple(inputs[g] for g in grads), dy=inputs.get("dy"))
    return build


def _prepare(case: GpuCase, impl: Impl):
    """(the callable to time, the checked outputs of its first call, which also compiles)."""
    if case.mode in ("fwd", "step"):
        out = impl.forward()
        if impl.result is not None:
            out = impl.result()
        out = _detach(out)
        return impl.forward, impl.out_to_ref(out) if impl.out_to_ref else out
    dy = impl.dy
    if case.mode == "bwd":
        y = impl.forward()

        def fn():
            return torch.autograd.grad(y, impl.leaves, dy, retain_graph=True)
    else:
        def fn():
            return torch.autograd.grad(impl.forward(), impl.leaves, dy)
    grads = _detach(fn())
    return fn, impl.grads_to_ref(grads) if impl.grads_to_ref else grads


def _inputs(case: GpuCase, device: torch.device) -> dict:
    with torch.no_grad():
        inputs = case.make(device)
    for g in case.grads:
        inputs[g].requires_grad_()
    return inputs


def kernel_profile(fn: Callable[[], object], device: torch.device, calls: int = 3, top: int = 6) -> list[dict]:
    """What one call of ``fn`` runs on the device, from ``torch.profiler`` over ``calls`` calls: the ``top``
    kernels by time, each ``{"name", "per_call", "us"}`` (launches and device µs per call), and a last entry
    ``{"name": "(all)", ...}`` with every kernel's. A rate below the kernel's own shows here as a second
    kernel, a copy or a conversion beside it, or as the gap between ``(all)`` and the timer's figure (time
    outside any kernel: the host, allocation). On a CPU device the operators' self CPU time stands in."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()  # compiled and allocated before the profile
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize(device)
    events = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) if cuda else e.self_cpu_time_total
        on_device = str(getattr(e, "device_type", "")).endswith("CUDA") if cuda else e.key.startswith("aten::")
        if on_device and us > 0:
            events.append({"name": e.key[:80], "per_call": e.count / calls, "us": us / calls})
    events.sort(key=lambda k: -k["us"])
    total = {"name": "(all)", "per_call": sum(k["per_call"] for k in events), "us": sum(k["us"] for k in events)}
    return events[:top] + [total]


def format_kernels(kernels: list[dict]) -> str:
    """``name ×launches µs; ...`` of :func:`kernel_profile`'s entries (per call)."""
    return "; ".join(f"{k['name']} ×{k['per_call']:g} {k['us']:.1f} µs" for k in kernels)


def run_case(case: GpuCase, device: torch.device, timer: Callable[[Callable[[], object]], float],
             copy_gbps: float | None, compile_backend: str | None = "inductor",
             on_row: Callable[[dict], None] | None = None, kernels: bool = False) -> list[dict]:
    """One row per implementation: ``ms`` (``timer``'s figure), ``gbps`` (``bytes_min`` over it), ``copy_pct``
    (of ``copy_gbps``), ``rel_err``; ``error`` instead where it failed; with ``kernels``, ``kernels``: what a
    call runs on the device (:func:`kernel_profile`). A :class:`CaseTimeout` stops the case: the rows done so
    far are kept (the caller reads them from ``on_row``)."""
    rows: list[dict] = []
    ref, ref_error = None, None
    try:
        inputs = _inputs(case, device)
        ref = case.reference(inputs) if case.reference is not None else None
        del inputs
    except Exception as exc:  # noqa: BLE001 - the timings still mean something without the error column
        ref_error = f"reference: {type(exc).__name__}: {exc}"
    builders = dict(case.impls)
    if case.compiled is not None and compile_backend:
        builders["torch.compile"] = compiled_impl(case.compiled, case.grads, compile_backend)
    for label, build in builders.items():
        row = {"case": case.name, "op": case.op, "mode": case.mode, "shape": case.shape,
               "dtype": SHORT[case.dtype], "impl": label, "bytes_min": case.bytes_min}
        try:
            inputs = _inputs(case, device)
            impl = build(inputs)
            fn, out = _prepare(case, impl)
            if ref is not None:
                row["rel_err"] = rel_err(out, ref)
            elif ref_error:
                row["note"] = ref_error[:200]
            del out
            ms = float(timer(fn))
            row["ms"] = ms
            row["gbps"] = case.bytes_min / (ms * 1e-3) / 1e9 if ms > 0 else None
            row["copy_pct"] = 100 * row["gbps"] / copy_gbps if copy_gbps and row["gbps"] else None
            if kernels:
                row["kernels"] = kernel_profile(fn, device)
        except Exception as exc:  # noqa: BLE001 - one failing implementation must not hide the others
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            traceback.print_exc()
        finally:
            inputs = impl = fn = None  # noqa: F841 - free this implementation's tensors before the next one
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def rate_rows(rows: list[dict]) -> None:
    """Add ``vs_best``: apex's time over the fastest other implementation of the same case (< 1: apex
    is faster)."""
    by_case: dict[str, list[dict]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r)
    for group in by_case.values():
        apex = next((r for r in group if r["impl"] == "apex" and r.get("ms")), None)
        others = [r["ms"] for r in group if r["impl"] != "apex" and r.get("ms")]
        if apex is not None and others:
            apex["vs_best"] = apex["ms"] / min(others)


def measure_copy(device: torch.device, timer: Callable[[Callable[[], object]], float],
                 nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (bytes read plus bytes written), timed by ``timer``."""
    n = nbytes // 4
    a = torch.empty(n, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    ms = float(timer(lambda: b.copy_(a)))
    return 2 * n * 4 / (ms * 1e-3) / 1e9


def do_bench_timer(warmup_ms: int = 10, rep_ms: int = 50) -> Callable[[Callable[[], object]], float]:
    """``triton.testing.do_bench``'s median (it empties the L2 cache before every repeat)."""
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")
