"""Tables, the chart and the environment line of ``benchmarks/run.py --device cuda``."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROW_HEAD = ("case", "impl", "ms", "GB/s", "% copy", "rel err", "apex/best", "error")


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def row_cells(r: dict) -> tuple[str, ...]:
    return (r["case"], r["impl"], _f(r.get("ms"), ".4f"), _f(r.get("gbps"), ",.0f"), _f(r.get("copy_pct"), ".0f"),
            _f(r.get("rel_err"), ".1e"), _f(r.get("vs_best"), ".2f"), (r.get("error") or r.get("note") or "")[:80])


def markdown_line(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_table(head, rows) -> str:
    """A markdown table with aligned columns."""
    table = [tuple(str(c) for c in head)] + [tuple(str(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in table]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """One line per case: each implementation's GB/s (and % of the copy rate), apex's time over the best
    other one. Cases are grouped by their set of implementations (the ops; the optimizers)."""
    groups: dict[tuple, dict[str, dict[str, dict]]] = {}
    for r in rows:
        key = tuple(x["impl"] for x in rows if x["case"] == r["case"])
        groups.setdefault(key, {}).setdefault(r["case"], {})[r["impl"]] = r
    out = []
    for labels, cases in groups.items():
        body = []
        for name, by_impl in cases.items():
            cells = [name]
            for label in labels:
                r = by_impl.get(label, {})
                if r.get("gbps") is not None:
                    pct = f" ({r['copy_pct']:.0f}%)" if r.get("copy_pct") is not None else ""
                    cells.append(f"{r['gbps']:,.0f}{pct}")
                else:
                    cells.append("error" if r.get("error") else "-")
            cells.append(_f(by_impl.get("apex", {}).get("vs_best"), ".2f"))
            body.append(cells)
        out.append(markdown_table(("case", *(f"{x} GB/s" for x in labels), "apex/best time"), body))
    return "\n\n".join(out)


def write_chart(rows: list[dict], copy_gbps: float | None, path: Path) -> bool:
    """Horizontal bars: each implementation's % of the copy rate per case. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    cases = list(dict.fromkeys(r["case"] for r in rows))
    labels = list(dict.fromkeys(r["impl"] for r in rows))
    value = {(r["case"], r["impl"]): r.get("copy_pct") if copy_gbps else r.get("gbps") for r in rows}
    height = 0.8 / max(len(labels), 1)
    fig, ax = plt.subplots(figsize=(11, max(4.0, 0.25 * len(cases) * max(len(labels), 1) ** 0.5 + 1)))
    for j, label in enumerate(labels):
        ys = [i + j * height for i in range(len(cases))]
        ax.barh(ys, [value.get((c, label)) or 0 for c in cases], height=height, label=label)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(cases))], cases, fontsize=7)
    ax.invert_yaxis()
    if copy_gbps:
        ax.axvline(100, color="k", lw=1)
        ax.set_xlabel(f"% of the measured device-to-device copy rate ({copy_gbps:,.0f} GB/s) over each case's "
                      "minimum bytes (higher is better)")
    else:
        ax.set_xlabel("GB/s over each case's minimum bytes")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _command(args: list[str]) -> str | None:
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment(device) -> dict:
    """Device, driver, torch, triton, CUDA and the checkout's commit: what a figure must be quoted with."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    here = Path(__file__).resolve().parent
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return {"device": name, "driver": _command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
            "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "commit": _command(["git", "-C", str(here), "rev-parse", "--short", "HEAD"])}


def describe(env: dict, copy_gbps: float | None) -> str:
    parts = [f"{env['device']}", f"driver {env.get('driver') or 'unknown'}", f"torch {env['torch']}",
             f"triton {env.get('triton') or 'absent'}", f"commit {env.get('commit') or 'unknown'}"]
    copy = f"; device-to-device copy measured {copy_gbps:,.0f} GB/s" if copy_gbps else ""
    return ", ".join(parts) + copy
