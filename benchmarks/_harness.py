"""Benchmark harness: CPU timing against PyTorch, and byte/launch counts of Triton kernels.

A benchmark module (``benchmarks/**/bench_*.py``) defines ``cases() -> list[Case]``. Each case builds its
inputs lazily, so only the cases being run allocate memory:

* ``timed()`` returns ``(ours, torch_best)``: two zero-argument callables doing the same work on the CPU,
  our path and the best PyTorch alternative. Both are timed in the same run (median of repeats). It may
  return a third item, a dict of facts about the case (bucket counts, say), kept in ``Result.extra``.
* ``counted()`` returns a :class:`Counted`: ``triton`` runs our Triton path under the interpreter (sizes
  small enough for it), ``eager`` does the same work in eager PyTorch, and ``bytes_min`` is what the
  operation must move at least (each input read once, each output written once).

Either part may be ``None`` (a case without a Triton kernel, or one that is only counted).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch


@dataclass
class Counted:
    triton: Callable[[], object]
    eager: Callable[[], object] | None
    bytes_min: int
    note: str = ""


@dataclass
class Case:
    name: str
    timed: Callable[[], tuple[Callable[[], object], Callable[[], object]]] | None = None
    counted: Callable[[], Counted] | None = None
    torch_label: str = "torch"
    repeats: int = 7
    warmup: int = 2


@dataclass
class Result:
    name: str
    ours_ms: float | None = None
    torch_ms: float | None = None
    ratio: float | None = None
    bytes_moved: int | None = None
    bytes_min: int | None = None
    launches: int | None = None
    eager_bytes: int | None = None
    eager_launches: int | None = None
    torch_label: str = ""
    extra: dict = field(default_factory=dict)

    def as_json(self) -> dict:
        return asdict(self)


def machine() -> str:
    """The CPU's model name, its cores, torch's version and threads: the line every report starts from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def _time(fn: Callable[[], object], repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def time_pair(ours: Callable, theirs: Callable, repeats: int = 7, warmup: int = 2) -> tuple[float, float]:
    """Median milliseconds of each, measured interleaved in one run so machine noise hits both alike.

    The order alternates every repeat (ours first, then theirs first), so neither side always runs right
    after the other has filled or evicted the caches.
    """
    for _ in range(warmup):
        ours()
        theirs()
    samples: dict[int, list[float]] = {0: [], 1: []}
    fns = (ours, theirs)
    for i in range(repeats):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            t0 = time.perf_counter()
            fns[which]()
            samples[which].append(time.perf_counter() - t0)
    return statistics.median(samples[0]) * 1e3, statistics.median(samples[1]) * 1e3


def run_case(case: Case, *, time_it: bool = True, count_it: bool = True) -> Result:
    import apex
    from apex.testing import TritonTrace, count_eager

    res = Result(name=case.name, torch_label=case.torch_label)
    if time_it and case.timed is not None:
        built = case.timed()
        ours, theirs = built[0], built[1]
        if len(built) > 2:
            res.extra.update(built[2])
        res.ours_ms, res.torch_ms = time_pair(ours, theirs, case.repeats, case.warmup)
        res.ratio = res.ours_ms / res.torch_ms if res.torch_ms else None
        del ours, theirs, built
    if count_it and case.counted is not None and os.environ.get("TRITON_INTERPRET") == "1":
        c = case.counted()
        with apex.backend("triton"), TritonTrace(bounds=False) as trace:
            c.triton()
        res.bytes_moved = trace.bytes_unique
        res.launches = trace.launches
        res.bytes_min = c.bytes_min
        res.extra["bytes_requested"] = trace.bytes_requested
        res.extra["kernels"] = dict(trace.kernels)
        if c.note:
            res.extra["note"] = c.note
        if c.eager is not None:
            with torch.no_grad() if not torch.is_grad_enabled() else _null():
                e = count_eager(c.eager)
            res.eager_bytes, res.eager_launches = e["bytes"], e["launches"]
            res.extra["eager_syncs"] = e["syncs"]
    return res


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


def format_table(results: list[Result]) -> str:
    head = ("case", "ours ms", "torch ms", "ratio", "vs", "triton bytes", "min bytes", "bytes/min",
            "launches", "eager bytes", "eager launches")
    rows = [head]
    for r in results:
        rows.append((
            r.name,
            f"{r.ours_ms:.3f}" if r.ours_ms is not None else "-",
            f"{r.torch_ms:.3f}" if r.torch_ms is not None else "-",
            f"{r.ratio:.2f}x" if r.ratio is not None else "-",
            r.torch_label if r.ours_ms is not None else "-",
            _fmt_bytes(r.bytes_moved),
            _fmt_bytes(r.bytes_min),
            f"{r.bytes_moved / r.bytes_min:.3f}" if r.bytes_moved and r.bytes_min else "-",
            str(r.launches) if r.launches is not None else "-",
            _fmt_bytes(r.eager_bytes),
            str(r.eager_launches) if r.eager_launches is not None else "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
