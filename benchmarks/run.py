"""Run the registered benchmark cases.

    python benchmarks/run.py                    # every case, table on stdout
    python benchmarks/run.py -k adam --json out.json
    python benchmarks/run.py --all              # also writes benchmarks/REPORT.md and benchmarks/report.png
    python benchmarks/run.py --device cuda      # on a GPU, in about three minutes (see below)
    python benchmarks/run.py --device cuda --quick -k layer_norm
    python benchmarks/run.py --device cuda --quick -k norm --kernels   # also what each call runs on the GPU

On the CPU, Triton kernels are counted under the interpreter, so this script turns it on before anything
imports a kernel module; the CPU timings are unaffected (CPU tensors take the PyTorch path).

With ``--device cuda`` the interpreter stays off. First the GPU-sized cases (``gpu_cases()`` of a benchmark
module, ``benchmarks/_gpu.py``): apex, eager PyTorch, ``torch.compile`` of the same PyTorch code and
Liger-Kernel where it is installed, each timed by ``triton.testing.do_bench`` (median) in this one process,
as GB/s over the case's minimum bytes, % of a device-to-device copy measured at the start, and the relative
error against an fp32 (fp64 for fp32 cases) reference. Then, at their CPU sizes, the cases of the other
modules that have a Triton kernel (``gpu_case``), so every kernel runs compiled. Cases without a Triton
kernel (amp steps, ASP search, the multi-rank cases) run only with ``--cpu-cases``. Every row is printed
as it is measured, each case is capped (``--case-cap``) and the run stops starting cases after
``--budget`` seconds, listing what it did not reach; the tables, JSON and chart go to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks._harness import Case, Result, format_table, machine, run_case  # noqa: E402


def modules():
    """(short name, module) of every ``benchmarks/**/bench_*.py``."""
    for path in sorted(HERE.rglob("bench_*.py")):
        rel = path.relative_to(HERE.parent).with_suffix("")
        yield path.stem.removeprefix("bench_"), importlib.import_module(".".join(rel.parts))


def discover() -> list[tuple[str, Case]]:
    found = []
    for stem, module in modules():
        for case in module.cases():
            found.append((stem, case))
    return found



def write_report(results: list[Result], path: Path) -> None:
    lines = [
        "# apex benchmark report",
        "",
        f"Machine: {machine()}.",
        "",
        "`ours ms`/`torch ms`: CPU time of apex's path and of the best PyTorch alternative named in `vs`,",
        "median of repeats, measured interleaved in one run. `triton bytes`: distinct bytes the Triton",
        "kernels read and write, counted under the interpreter at the case's counting size; `min bytes`: each",
        "input read once and each output written once; `eager`: the same work done by eager PyTorch ops.",
        "",
        format_table(results),
        "",
    ]
    notes = [(r.name, {k: v for k, v in r.extra.items() if k not in ("kernels", "bytes_requested")})
             for r in results]
    notes = [(name, facts) for name, facts in notes if facts]
    if notes:
        lines += ["## Notes per case", ""]
        lines += [f"- **{name}**: " + "; ".join(f"{k} = {v}" for k, v in facts.items()) for name, facts in notes]
        lines.append("")
    path.write_text("\n".join(lines))


def write_chart(results: list[Result], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in results if r.ratio is not None]
    counted = [r for r in results if r.bytes_moved and r.bytes_min]
    fig, axes = plt.subplots(1, 2, figsize=(14, max(4, 0.35 * max(len(timed), len(counted), 1))))
    ax = axes[0]
    ax.barh([r.name for r in timed], [r.ratio for r in timed], color="tab:blue")
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xlabel("CPU time, apex / best PyTorch (lower is better)")
    ax.invert_yaxis()
    ax = axes[1]
    ax.barh([r.name for r in counted], [r.bytes_moved / r.bytes_min for r in counted], color="tab:green",
            label="Triton kernel")
    eager = [(r.eager_bytes or 0) / r.bytes_min for r in counted]
    ax.scatter(eager, [r.name for r in counted], color="tab:red", marker="x", label="eager PyTorch", zorder=3)
    ax.axvline(1.0, color="k", lw=1)
    ax.set_xlabel("bytes moved / minimum (interpreter count; 1 = minimum)")
    ax.legend(loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def gpu_case(case: Case, device, peak_gbps: float | None, timer=None) -> dict:
    """One CPU-sized case on the GPU: the case's inputs, written for CPU tensors, are made on ``device``
    (``apex.testing.device.OnDevice``) and apex's path (the compiled Triton kernels) is timed against the
    case's PyTorch alternative (the same eager/fused PyTorch code, on the GPU): with ``timer`` (one callable
    at a time) where given, otherwise with CUDA events, interleaved.

    Bandwidth: the case's ``counted()`` work -- whose minimum bytes (each input read once, each output
    written once) are known -- is timed too, for apex's kernel and for eager PyTorch; GB/s is that minimum
    over the time, and ``% peak`` its fraction of ``peak_gbps`` (the measured copy rate). A ``timed()`` case
    that states its own ``bytes_min`` in its facts gets the same figures at the timed size.
    """
    import torch

    from apex.testing import device as dev
    from apex.testing.device import OnDevice

    row: dict = {"name": case.name, "vs": case.torch_label}
    one = timer or dev.cuda_time
    pair = (lambda a, b: (timer(a), timer(b))) if timer else dev.cuda_time_pair

    def rate(nbytes: int, ms: float) -> tuple[float, float | None]:
        gbps = nbytes / (ms * 1e-3) / 1e9
        return gbps, (gbps / peak_gbps if peak_gbps else None)

    try:
        if case.timed is not None:
            with OnDevice(device):
                built = case.timed()
            ours, theirs = built[0], built[1]
            facts = built[2] if len(built) > 2 else {}
            row["ours_ms"], row["torch_ms"] = pair(ours, theirs)
            row["ratio"] = row["ours_ms"] / row["torch_ms"] if row["torch_ms"] else None
            if facts.get("bytes_min"):
                row["timed_gbps"], row["timed_peak"] = rate(int(facts["bytes_min"]), row["ours_ms"])
            del ours, theirs, built
        if case.counted is not None:
            with OnDevice(device):
                c = case.counted()
            row["counted_bytes"] = c.bytes_min
            row["counted_ms"] = one(c.triton)
            row["gbps"], row["peak"] = rate(c.bytes_min, row["counted_ms"])
            if c.eager is not None:
                with torch.no_grad() if not torch.is_grad_enabled() else torch.enable_grad():
                    row["eager_ms"] = one(c.eager)
                row["eager_gbps"], row["eager_peak"] = rate(c.bytes_min, row["eager_ms"])
    except Exception as exc:  # one failing case must not hide the others' figures
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    return row


def format_gpu_table(rows: list[dict]) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    head = ("case", "ours ms", "torch ms", "ratio", "vs", "min bytes", "ours GB/s", "% copy", "eager GB/s",
            "eager % copy", "error")
    table = [head] + [(
        r["name"], f(r.get("ours_ms"), ".4f"), f(r.get("torch_ms"), ".4f"),
        f(r.get("ratio"), ".2f") + ("x" if r.get("ratio") is not None else ""), r["vs"],
        f(r.get("counted_bytes"), ",d"), f(r.get("gbps"), ".0f"),
        f(None if r.get("peak") is None else 100 * r["peak"], ".0f"), f(r.get("eager_gbps"), ".0f"),
        f(None if r.get("eager_peak") is None else 100 * r["eager_peak"], ".0f"), r.get("error", "")[:60])
        for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    lines = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |" for row in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# A run cut short by its budget has reached one shape of every operation first (the --quick subset), then
# the other bf16 shapes, the optimizers, fp16.
_DTYPE_ORDER = {"bf16": 0, "fp32": 1, "fp16": 2}


def cuda_plan(selected: str = "", quick: bool = False, cpu_cases: bool = False):
    """What ``--device cuda`` runs, in order: the GPU-sized cases, then the CPU-sized cases of the modules
    without GPU-sized ones that have a Triton kernel (``counted``), or all of them with ``cpu_cases``."""
    from benchmarks._gpu import SHORT

    gpu, small = [], []
    for stem, module in modules():
        own = list(module.gpu_cases()) if hasattr(module, "gpu_cases") else []
        gpu += [c for c in own if (selected in c.name or selected in stem) and (c.quick or not quick)]
        if own or quick:
            continue  # the GPU-sized cases run the same kernels at sizes that measure them
        small += [(stem, c) for c in module.cases()
                  if (selected in c.name or selected in stem) and (c.counted is not None or cpu_cases)]
    gpu.sort(key=lambda c: (not c.quick, _DTYPE_ORDER.get(SHORT[c.dtype], 3)))
    return gpu, small


class _Stopped(BaseException):
    """SIGTERM (``timeout`` ending the run): write what was measured. Not an Exception, so the per-case
    ``except Exception`` does not take it for a failing implementation and go on."""


def _stop(signum, frame):
    raise _Stopped(f"signal {signum}")


def run_cuda(args, device=None, timer=None) -> int:
    """``--device cuda``. ``device`` and ``timer`` are for the tests, which run this on CPU tensors."""
    import signal

    import torch

    from benchmarks import _gpu
    from benchmarks import _gpu_report as rep

    if device is None:
        if not torch.cuda.is_available():
            print("error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    gpu, small = cuda_plan(args.k, args.quick, args.cpu_cases)
    timer = timer or _gpu.do_bench_timer()
    backend = None if args.no_compile else args.compile_backend
    start = time.monotonic()
    copy = _gpu.measure_copy(device, timer, args.copy_bytes)
    env = rep.environment(device)
    print(f"# {rep.describe(env, copy)}", flush=True)
    print(f"# {len(gpu)} GPU-sized cases, then {len(small)} CPU-sized; Liger-Kernel "
          f"{'found' if _gpu.liger_available() else 'not installed'}; budget {args.budget:.0f} s, "
          f"{args.case_cap:.0f} s a case", flush=True)
    rows, small_rows, not_reached = [], [], []
    previous = signal.signal(signal.SIGTERM, _stop) if hasattr(signal, "SIGTERM") else None
    print(rep.markdown_line(rep.ROW_HEAD) + "\n" + rep.markdown_line(["---"] * len(rep.ROW_HEAD)), flush=True)
    try:
        for case in gpu:
            left = args.budget - (time.monotonic() - start)
            if left <= 0:
                not_reached.append(case.name)
                continue
            done: list[dict] = []

            def on_row(r, done=done):
                done.append(r)
                print(rep.markdown_line(rep.row_cells(r)), flush=True)
                if r.get("kernels"):
                    print(f"#   {r['impl']} kernels per call: {_gpu.format_kernels(r['kernels'])}", flush=True)
            try:
                with _gpu.time_cap(min(args.case_cap, left)):
                    _gpu.run_case(case, device, timer, copy, backend, on_row, kernels=args.kernels)
            except _gpu.CaseTimeout as exc:
                seen = {r["impl"] for r in done}
                labels = [x for x in case.labels if x not in seen and (backend or x != "torch.compile")]
                on_row({"case": case.name, "impl": ", ".join(labels) or "-", "error": f"CaseTimeout: {exc}"})
            rows += done
            _release(device)
        for _, case in small:
            left = args.budget - (time.monotonic() - start)
            if left <= 0:
                not_reached.append(case.name)
                continue
            try:
                with _gpu.time_cap(min(args.case_cap, left)):
                    small_rows.append(gpu_case(case, device, copy, timer))
            except _gpu.CaseTimeout as exc:
                small_rows.append({"name": case.name, "vs": case.torch_label, "error": f"CaseTimeout: {exc}"})
            r = small_rows[-1]
            print(f"# CPU-sized {r['name']}: ours {r.get('ours_ms') or r.get('counted_ms') or '-'} ms"
                  + (f", error {r['error'][:100]}" if r.get("error") else ""), file=sys.stderr, flush=True)
            _release(device)
    except (_Stopped, KeyboardInterrupt) as exc:
        not_reached.append(f"(stopped: {exc or 'interrupted'})")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _gpu.rate_rows(rows)
        report = _cuda_report(args, env, copy, rows, small_rows, not_reached, time.monotonic() - start)
        print("\n" + report)
    return 1 if any("error" in r for r in rows + small_rows) else 0


def _release(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _cuda_report(args, env, copy, rows, small_rows, not_reached, seconds) -> str:
    from benchmarks import _gpu
    from benchmarks import _gpu_report as rep

    lines = [f"# GPU benchmark: {rep.describe(env, copy)}", "",
             f"{len({r['case'] for r in rows})} GPU-sized cases and {len(small_rows)} CPU-sized ones in "
             f"{seconds:.0f} s. GB/s: each case's minimum bytes (every input read once, every output written "
             "once) over the median time of triton.testing.do_bench; % copy: of the device-to-device copy "
             "measured at the start; rel err: ||out - ref|| / ||ref|| against fp32 (fp64 for fp32 cases), the "
             "worst output; apex/best: apex's time over the fastest other implementation (< 1: apex faster).",
             "", rep.summary(rows) if rows else "(no GPU-sized case ran)", "", "## Every row", "",
             rep.markdown_table(rep.ROW_HEAD, [rep.row_cells(r) for r in rows])]
    profiled = [r for r in rows if r.get("kernels")]
    if profiled:
        lines += ["", "## Kernels per call (torch.profiler, device µs; (all): every kernel of the call)", "",
                  rep.markdown_table(["case", "impl", "ms", "kernels"],
                                     [[r["case"], r["impl"], f"{r['ms']:.4f}", _gpu.format_kernels(r["kernels"])]
                                      for r in profiled])]
    if small_rows:
        lines += ["", "## CPU-sized cases on the GPU (every other Triton kernel, compiled)", "",
                  format_gpu_table(small_rows)]
    if not_reached:
        lines += ["", f"Not reached within the {args.budget:.0f} s budget: " + "; ".join(not_reached)]
    report = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text(report)
    data = {"environment": env, "copy_gbps": copy, "rows": rows, "cpu_sized": small_rows,
            "not_reached": not_reached, "seconds": seconds}
    for path in {out / "gpu.json", *([args.json] if args.json else [])}:
        Path(path).write_text(json.dumps(data, indent=1, default=str))
    chart = rep.write_chart(rows, copy, out / "gpu.png") if rows else False
    print(f"wrote {out / 'gpu.md'}, {out / 'gpu.json'}" + (f" and {out / 'gpu.png'}" if chart else ""),
          file=sys.stderr)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", "--filter", dest="k", default="",
                   help="run only cases whose name (or module) contains this text")
    p.add_argument("--json", type=Path, help="write the numbers to this file")
    p.add_argument("--all", action="store_true", help="run everything and write REPORT.md and report.png")
    p.add_argument("--no-time", action="store_true", help="skip CPU timing")
    p.add_argument("--no-count", action="store_true", help="skip interpreter byte counting")
    p.add_argument("--list", action="store_true", help="list case names and exit")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: CPU timings + interpreter byte counts; cuda: compiled kernels timed on the GPU")
    g = p.add_argument_group("--device cuda")
    g.add_argument("--quick", action="store_true",
                   help="one shape per operation in bf16, one optimizer set; no CPU-sized cases")
    g.add_argument("--budget", type=float, default=165.0,
                   help="start no case after this many seconds (default 165: the run answers in about 3 min)")
    g.add_argument("--case-cap", type=float, default=40.0, help="stop one case after this many seconds")
    g.add_argument("--cpu-cases", action="store_true",
                   help="also run the CPU-sized cases without a Triton kernel (amp steps, ASP search, ...)")
    g.add_argument("--no-compile", action="store_true", help="leave out the torch.compile rows")
    g.add_argument("--kernels", action="store_true",
                   help="also profile each row's call: the kernels it launches and their device time")
    g.add_argument("--compile-backend", default="inductor", help=argparse.SUPPRESS)
    g.add_argument("--copy-bytes", type=int, default=1 << 30, help=argparse.SUPPRESS)
    g.add_argument("--out", type=Path, default=HERE / "results",
                   help="folder for gpu.md, gpu.json and gpu.png (default benchmarks/results, not tracked)")
    args = p.parse_args(argv)
    if args.device == "cuda":
        os.environ["TRITON_INTERPRET"] = "0"  # set before any kernel module is imported
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from apex.testing import prepare_interpreter

        prepare_interpreter()

    if args.device == "cuda":
        if args.all:
            p.error("--all writes the CPU report; it does not combine with --device cuda")
        if args.list:
            gpu, small = cuda_plan(args.k, args.quick, args.cpu_cases)
            print("\n".join([f"{c.name}  [{', '.join(c.labels)}]" for c in gpu]
                            + [f"{c.name}  [CPU-sized]" for _, c in small]))
            return 0
        return run_cuda(args)
    cases = [(m, c) for m, c in discover() if args.k in c.name or args.k in m]
    if args.list:
        print("\n".join(c.name for _, c in cases))
        return 0
    results = []
    for _, case in cases:
        print(f"running {case.name} ...", file=sys.stderr, flush=True)
        results.append(run_case(case, time_it=not args.no_time, count_it=not args.no_count))
    print(format_table(results))
    if args.json:
        args.json.write_text(json.dumps([r.as_json() for r in results], indent=1))
    if args.all:
        write_report(results, HERE / "REPORT.md")
        write_chart(results, HERE / "report.png")
        print(f"wrote {HERE / 'REPORT.md'} and {HERE / 'report.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
