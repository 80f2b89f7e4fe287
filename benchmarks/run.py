"""Run the registered benchmark cases.

    python benchmarks/run.py                    # every case, table on stdout
    python benchmarks/run.py -k adam --json out.json
    python benchmarks/run.py --all              # also writes benchmarks/REPORT.md and benchmarks/report.png
    python benchmarks/run.py --device cuda      # compiled kernels on a GPU: CUDA-event times, GB/s, % of peak

On the CPU, Triton kernels are counted under the interpreter, so this script turns it on before anything
imports a kernel module; the CPU timings are unaffected (CPU tensors take the PyTorch path). With
``--device cuda`` the interpreter stays off and every case runs on the GPU (see ``gpu_case``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks._harness import Case, Result, format_table, run_case  # noqa: E402


def discover() -> list[tuple[str, Case]]:
    found = []
    for path in sorted(HERE.rglob("bench_*.py")):
        rel = path.relative_to(HERE.parent).with_suffix("")
        module = importlib.import_module(".".join(rel.parts))
        for case in module.cases():
            found.append((path.stem.removeprefix("bench_"), case))
    return found


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


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


def gpu_case(case: Case, device, peak_gbps: float | None) -> dict:
    """One case on the GPU: the case's inputs, written for CPU tensors, are made on ``device``
    (``apex.testing.device.OnDevice``) and apex's path (the compiled Triton kernels) is timed against the
    case's PyTorch alternative (the same eager/fused PyTorch code, on the GPU) with CUDA events, interleaved.

    Bandwidth: the case's ``counted()`` work -- whose minimum bytes (each input read once, each output
    written once) are known -- is timed too, for apex's kernel and for eager PyTorch; GB/s is that minimum
    over the time, and ``% peak`` its fraction of ``peak_gbps``. A ``timed()`` case that states its own
    ``bytes_min`` in its facts gets the same figures at the timed size.
    """
    import torch

    from apex.testing.device import OnDevice, cuda_time, cuda_time_pair

    row: dict = {"name": case.name, "vs": case.torch_label}

    def rate(nbytes: int, ms: float) -> tuple[float, float | None]:
        gbps = nbytes / (ms * 1e-3) / 1e9
        return gbps, (gbps / peak_gbps if peak_gbps else None)

    try:
        if case.timed is not None:
            with OnDevice(device):
                built = case.timed()
            ours, theirs = built[0], built[1]
            facts = built[2] if len(built) > 2 else {}
            row["ours_ms"], row["torch_ms"] = cuda_time_pair(ours, theirs)
            row["ratio"] = row["ours_ms"] / row["torch_ms"] if row["torch_ms"] else None
            if facts.get("bytes_min"):
                row["timed_gbps"], row["timed_peak"] = rate(int(facts["bytes_min"]), row["ours_ms"])
            del ours, theirs, built
        if case.counted is not None:
            with OnDevice(device):
                c = case.counted()
            row["counted_bytes"] = c.bytes_min
            row["counted_ms"] = cuda_time(c.triton)
            row["gbps"], row["peak"] = rate(c.bytes_min, row["counted_ms"])
            if c.eager is not None:
                with torch.no_grad() if not torch.is_grad_enabled() else torch.enable_grad():
                    row["eager_ms"] = cuda_time(c.eager)
                row["eager_gbps"], row["eager_peak"] = rate(c.bytes_min, row["eager_ms"])
    except Exception as exc:  # one failing case must not hide the others' figures
        row["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    return row


def format_gpu_table(rows: list[dict]) -> str:
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    head = ("case", "ours ms", "torch ms", "ratio", "vs", "min bytes", "ours GB/s", "% peak", "eager GB/s",
            "eager % peak", "error")
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


def run_cuda(cases: list[tuple[str, Case]], json_path: Path | None) -> int:
    import torch

    from apex.testing.device import copy_bandwidth, peak_bandwidth

    if not torch.cuda.is_available():
        print("error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    name = torch.cuda.get_device_name(device)
    sheet, measured = peak_bandwidth(name), copy_bandwidth(device)
    peak = sheet or measured
    print(f"{name}: peak {f'{sheet:,.0f} GB/s (data sheet)' if sheet else 'unknown'}; device-to-device "
          f"copy measured {measured:,.0f} GB/s; % peak below is of {peak:,.0f} GB/s", flush=True)
    rows = []
    for _, case in cases:
        print(f"running {case.name} ...", file=sys.stderr, flush=True)
        rows.append(gpu_case(case, device, peak))
    print(format_gpu_table(rows))
    if json_path:
        json_path.write_text(json.dumps({"device": name, "peak_gbps": sheet, "copy_gbps": measured,
                                         "cases": rows}, indent=1))
    return 1 if any("error" in r for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default="", help="run only cases whose name contains this text")
    p.add_argument("--json", type=Path, help="write one JSON object per case to this file")
    p.add_argument("--all", action="store_true", help="run everything and write REPORT.md and report.png")
    p.add_argument("--no-time", action="store_true", help="skip CPU timing")
    p.add_argument("--no-count", action="store_true", help="skip interpreter byte counting")
    p.add_argument("--list", action="store_true", help="list case names and exit")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: CPU timings + interpreter byte counts; cuda: compiled kernels timed on the GPU")
    args = p.parse_args(argv)
    if args.device == "cuda":
        os.environ["TRITON_INTERPRET"] = "0"  # set before any kernel module is imported
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") == "1":
        from apex.testing import prepare_interpreter

        prepare_interpreter()

    cases = [(m, c) for m, c in discover() if args.k in c.name or args.k in m]
    if args.list:
        print("\n".join(c.name for _, c in cases))
        return 0
    if args.device == "cuda":
        if args.all:
            p.error("--all writes the CPU report; it does not combine with --device cuda")
        return run_cuda(cases, args.json)
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
