"""Run the registered benchmark cases.

    python benchmarks/run.py                    # every case, table on stdout
    python benchmarks/run.py -k adam --json out.json
    python benchmarks/run.py --all              # also writes benchmarks/REPORT.md and benchmarks/report.png

Triton kernels are counted under the interpreter, so this script turns it on before anything imports a
kernel module; the CPU timings are unaffected (CPU tensors take the PyTorch path).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default="", help="run only cases whose name contains this text")
    p.add_argument("--json", type=Path, help="write one JSON object per case to this file")
    p.add_argument("--all", action="store_true", help="run everything and write REPORT.md and report.png")
    p.add_argument("--no-time", action="store_true", help="skip CPU timing")
    p.add_argument("--no-count", action="store_true", help="skip interpreter byte counting")
    p.add_argument("--list", action="store_true", help="list case names and exit")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        from apex.testing import prepare_interpreter

        prepare_interpreter()

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
