"""The printed table, ``metrics.json`` and the loss plots of ``train_gpt.py``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from _common import format_table, plot_losses

LABELS = {"apex": "apex", "torch": "PyTorch"}


def write_progress(directory: Path, runs: list, step: int) -> None:
    """``metrics.json`` (``"finished": false``) and the loss plot as of the validation at ``step``; the end of
    the run overwrites both with the full report."""
    directory.mkdir(parents=True, exist_ok=True)
    partial = {"steps": step, "finished": False, "runs": {
        r.impl: {"impl": r.impl, "dtype": str(r.dtype).replace("torch.", ""), "opt_level": r.opt_level,
                 "why": r.why, "tokens_per_s": r.tokens_per_s(), "history": r.history} for r in runs}}
    tmp = directory / "metrics.json.tmp"
    tmp.write_text(json.dumps(partial, indent=1))
    os.replace(tmp, directory / "metrics.json")  # never a half-written file, whenever Ctrl-C comes
    plot_losses(directory / ("compare.png" if len(runs) == 2 else "loss.png"),
                {f"{LABELS[r.impl]} {partial['runs'][r.impl]['dtype']}": r.history for r in runs},
                f"step {step} of {runs[0].args.steps} (in progress)")


def progress_text(run, loss: float) -> str:
    """The progress bar's text for ``run``: the step's loss, then the last validation and the speed once each
    exists (a process does not time its first step, which pays one-off costs, so the speed starts at the
    second)."""
    parts = [f"loss {loss:.3f}"]
    if run.history["val"]:
        at, v = run.history["val"][-1]
        parts.append(f"val {v:.3f} (step {at})")
    rate = run.tokens_per_s()
    if math.isfinite(rate):
        parts.append(f"{rate:,.0f} tok/s")
    return " ".join(parts)


def timed_range(r: dict) -> str:
    """The 1-based steps that a run's tokens/s and train time cover: the last ``timed_steps`` of its steps (a
    resumed run times only the steps after the resume, and no process times its first step)."""
    n, last = r.get("timed_steps", 0), r["steps"]
    return f"steps {last - n + 1}-{last}" if n else "no step timed"


def describe(r: dict, norm: str) -> str:
    if "parallel" in r:  # apex.transformer: precision through the schedule's autocast, not amp.initialize
        lay, norm_name = r["parallel"], ("LayerNorm" if norm == "layer" else "RMSNorm")
        how = "fp32" if r["dtype"] == "float32" else f"autocast {r['dtype']}"
        kit = f"FusedAdam, Fused{norm_name}" if r["impl"] == "apex" else f"AdamW, nn.{norm_name}"
        return f"TP {lay['tensor']} x PP {lay['pipeline']} x DP {lay['data']}, {how}, {kit}"
    if r["impl"] == "apex":
        return f"amp {r['opt_level']} {r['dtype']}, FusedAdam, Fused{'LayerNorm' if norm == 'layer' else 'RMSNorm'}"
    return f"fp32, AdamW, nn.{'LayerNorm' if norm == 'layer' else 'RMSNorm'}"


def report(out: dict, directory: Path) -> None:
    runs = list(out["runs"].values())
    norm = out["config"]["norm"]
    rel = lambda k: f"{runs[0][k] / runs[1][k] - 1:+.2%}"
    ratio = lambda k: f"{runs[0][k] / runs[1][k]:.2f}x"
    first, timed = out.get("first_step", 0), timed_range(runs[0])  # runs side by side run the same steps
    rows = [
        ("", [LABELS[r["impl"]] for r in runs], "apex / PyTorch"),
        ("setup", [describe(r, norm) for r in runs], ""),
        ("precision chosen by", [r["why"] for r in runs], ""),
        ("attention", [r["attention"] for r in runs], ""),
        ("parameters", [f"{r['params'] / 1e6:.2f} M" for r in runs], ""),
        ("steps", [str(r["steps"]) + (f" (resumed at step {first})" if first else "") for r in runs], ""),
        ("ranks x threads", [f"{out['world_size']} x {out['threads']}" for r in runs], ""),
        (f"tokens/s ({timed})", [f"{r['tokens_per_s']:,.0f}" for r in runs], lambda: ratio("tokens_per_s")),
        (f"train time (s, {timed})", [f"{r['train_time_s']:.1f}" for r in runs], lambda: ratio("train_time_s")),
        (f"train loss (mean of last {runs[0]['train_tail']} steps)", [f"{r['final_train_loss']:.4f}" for r in runs],
         lambda: rel("final_train_loss")),
        ("final val loss", [f"{r['final_val_loss']:.4f}" for r in runs], lambda: rel("final_val_loss")),
        ("val loss drop", [f"{1 - r['final_val_loss'] / r['first_val_loss']:.0%} (from {r['first_val_loss']:.2f})"
                           for r in runs], ""),
        ("weights + optimizer state (MiB)", [f"{r['state_mib']:.1f}" for r in runs], lambda: ratio("state_mib")),
    ]
    compare = len(runs) == 2
    table = [[name, *cells, (last() if callable(last) else last)] if compare else [name, *cells]
             for name, cells, last in rows[1:]]
    print(format_table(table, ["", *rows[0][1], rows[0][2]] if compare else ["", *rows[0][1]]))
    print(f"peak memory ({out['peak_memory_kind']}{', both runs' if compare else ''}): "
          f"{out['peak_memory_mib']:,.0f} MiB")
    if compare:
        print(f"speed ratio (tokens/s, apex / PyTorch): {out['speed_ratio']:.2f}x; "
              f"final val loss difference: {out['val_loss_rel_diff']:+.2%}")
        title = (f"apex {runs[0]['dtype']} runs at {out['speed_ratio']:.2f}x the speed of PyTorch fp32; "
                 f"final val loss differs by {out['val_loss_rel_diff']:+.2%}")
    else:
        title = f"byte-level GPT on the Python stdlib ({runs[0]['params'] / 1e6:.1f}M params, {runs[0]['dtype']})"
    plot = plot_losses(directory / ("compare.png" if compare else "loss.png"),
                       {f"{LABELS[r['impl']]} {r['dtype']}": r["history"] for r in runs}, title)
    print(f"loss curves: {plot}")
    if "sample" in out:
        print("sample (apex model, prompt 'def '):\n" + "-" * 60 + "\n" + out["sample"] + "\n" + "-" * 60)
