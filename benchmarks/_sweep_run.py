"""The runner of ``benchmarks/sweep_kernels.py``: compile ahead and model in worker processes, time every
candidate, pick the fastest, write the results and (``--write``) the table the launchers read."""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import pprint
import signal
import sys
import time
from pathlib import Path

import torch

from benchmarks import sweep_kernels as sk

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Stopped(BaseException):
    """SIGTERM: stop, and still write what was measured (not an Exception: a per-case handler must not
    take it for a failing candidate)."""


def _stop(signum, frame):
    raise Stopped(f"signal {signum}")


def _fmt(cfg: dict | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (cfg or {}).items()) or "-"


# ----------------------------------------------------------------------------- compiling and modelling
def model_one(job: tuple) -> dict:
    """Worker: compile one candidate (``None``: the formula) of one case for ``target`` on uninitialised CPU
    tensors -- which fills Triton's cache for the timed process -- and return the occupancy model of its
    main (first) launch."""
    index, cand, dtype_name, small, target, dev_key = job
    os.environ["TRITON_INTERPRET"] = "0"
    from apex._kernels import _tuning
    from apex.testing import occupancy as occ

    dev = occ.device_for(dev_key)
    case = sk.cases(DTYPES[dtype_name], sk.SMALL if small else None, dev.sms)[index]
    cfg = case.candidates[cand] if cand is not None else {}
    try:
        with _tuning.assume_device(dev.name, dev.sms), occ.capture(target) as launches, \
                _tuning.override(case.op, **cfg):
            case.run(case.make(torch.device("cpu"), False))
            used = dict(_tuning.last.get(case.op, cfg))
        main = launches[0]
        res = occ.resources(main.kernel)
        per = case.pass_bytes(used) if case.pass_bytes else None
        est = occ.estimate(res, dev, programs=main.programs, read_bytes=case.read_bytes,
                           write_bytes=case.write_bytes, passes=case.passes(used, main.programs),
                           read_bytes_per_pass=per)
    except Exception as exc:  # noqa: BLE001 - one candidate that does not compile must not stop the others
        return {"index": index, "cand": cand, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    return {"index": index, "cand": cand, "config": used, "regs": res.regs,
            "spills": res.spill_stores + res.spill_loads, "resident": est.resident, "limiter": est.limiter,
            "in_flight_kib": round(est.in_flight_per_sm / 1024, 1), "latency_pct": round(100 * est.latency_fraction),
            "issue_pct": round(100 * est.issue_fraction), "bound_pct": round(100 * est.bound),
            "launches": len(launches)}


def model_all(selected: list[tuple[int, sk.SweepCase]], dtype_name: str, small: bool, target: str, dev_key: str,
              jobs: int, cap: float) -> dict[tuple, dict]:
    """``model_one`` of every candidate of ``selected``, in ``jobs`` processes, for at most ``cap`` seconds."""
    work = [(i, c, dtype_name, small, target, dev_key) for i, case in selected
            for c in [None, *range(len(case.candidates))]]
    out: dict[tuple, dict] = {}
    if not work:
        return out
    start = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    env = {"TRITON_INTERPRET": "0"}
    os.environ.update(env)
    with cf.ProcessPoolExecutor(max_workers=max(1, jobs), mp_context=ctx) as pool:
        futures = [pool.submit(model_one, job) for job in work]
        try:
            for fut in cf.as_completed(futures, timeout=cap):
                r = fut.result()
                out[(r["index"], r["cand"])] = r
        except cf.TimeoutError:
            print(f"# compiling/modelling stopped at its {cap:.0f} s cap: {len(out)} of {len(work)} done",
                  file=sys.stderr, flush=True)
            for fut in futures:
                fut.cancel()
    print(f"# {len(out)} candidates compiled and modelled in {time.monotonic() - start:.0f} s", file=sys.stderr,
          flush=True)
    return out


# ----------------------------------------------------------------------------- timing
def time_case(case: sk.SweepCase, device, timer, copy_gbps: float | None) -> list[dict]:
    """One row per configuration: the launcher's formula first, then every candidate."""
    from apex._kernels import _tuning

    inputs = case.make(device, True)
    rows = []
    for cand, cfg in [(None, {})] + list(enumerate(case.candidates)):
        row = {"case": case.name, "cand": cand, "config": cfg}
        try:
            with _tuning.override(case.op, **cfg):
                ms = float(timer(lambda: case.run(inputs)))
                row["config"] = dict(_tuning.last.get(case.op, cfg))
            row.update(ms=ms, gbps=case.bytes_min / (ms * 1e-3) / 1e9)
            row["copy_pct"] = 100 * row["gbps"] / copy_gbps if copy_gbps else None
        except Exception as exc:  # noqa: BLE001 - a failing candidate is a row, not the end of the case
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        rows.append(row)
    return rows


def summarise(case: sk.SweepCase, rows: list[dict], model: dict) -> dict:
    timed = [r for r in rows if r.get("ms")]
    best = min(timed, key=lambda r: r["ms"]) if timed else None
    formula = rows[0] if rows and rows[0]["cand"] is None and rows[0].get("ms") else None
    for r in rows:
        r["model"] = model.get(r["cand"])
    return {"case": case.name, "op": case.op, "shape": list(case.shape), "key": list(case.key),
            "itemsize": case.dtype.itemsize, "bytes_min": case.bytes_min, "best": best, "formula": formula,
            "rows": rows}


def winners_table(results: list[dict]) -> str:
    from benchmarks._gpu_report import markdown_table

    head = ("case", "formula", "GB/s", "best", "GB/s", "% copy", "speed-up", "model bound %")
    body = []
    for r in results:
        b, f = r["best"], r["formula"]
        body.append((r["case"], _fmt(f and f["config"]), f"{f['gbps']:,.0f}" if f else "-",
                     _fmt(b and b["config"]), f"{b['gbps']:,.0f}" if b else "-",
                     f"{b['copy_pct']:.0f}" if b and b.get("copy_pct") else "-",
                     f"{f['ms'] / b['ms']:.2f}x" if b and f else "-",
                     (b.get("model") or {}).get("bound_pct", "-") if b else "-"))
    return markdown_table(head, body)


def model_table(selected, model: dict) -> str:
    from benchmarks._gpu_report import markdown_table

    head = ("case", "config", "regs", "spills", "programs/SM", "KiB in flight", "latency %", "issue %", "bound %")
    body = []
    for i, case in selected:
        for cand in [None, *range(len(case.candidates))]:
            m = model.get((i, cand))
            if m is None:
                continue
            label = ("formula: " if cand is None else "") + _fmt(m.get("config"))
            if "error" in m:
                body.append((case.name, label, "-", "-", "-", "-", "-", "-", m["error"][:60]))
                continue
            body.append((case.name, label, m["regs"], m["spills"], f"{m['resident']} ({m['limiter']})",
                         m["in_flight_kib"], m["latency_pct"], m["issue_pct"], m["bound_pct"]))
    return markdown_table(head, body)


def write_outputs(out: Path, header: str, results: list[dict], not_reached: list[str]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = "\n".join([f"# Kernel configuration sweep: {header}", "", winners_table(results), ""]
                     + ([f"Not reached: {'; '.join(not_reached)}", ""] if not_reached else []))
    (out / "sweep.md").write_text(text)
    (out / "sweep.json").write_text(json.dumps({"header": header, "results": results, "not_reached": not_reached},
                                               indent=1, default=str))
    return text


def _literal(value) -> str:
    """``value`` as a parenthesised, indented literal whose lines stay within the project's 120 columns."""
    body = pprint.pformat(value, width=110, sort_dicts=True)
    return "(\n" + "\n".join("    " + line for line in body.splitlines()) + "\n)"


def write_table(path: Path, device_name: str, note: str, results: list[dict]) -> int:
    """Merge the winners into the table file under ``device_name``; returns the number of entries written."""
    namespace: dict = {}
    if path.exists():
        exec(compile(path.read_text(), str(path), "exec"), namespace)  # noqa: S102 - our own generated file
    tables, notes = namespace.get("TABLES", {}), namespace.get("NOTES", {})
    mine = tables.setdefault(device_name, {})
    written = 0
    for r in results:
        if not r["best"]:
            continue
        entries = [e for e in mine.get(r["op"], []) if (e["itemsize"], list(e["key"])) != (r["itemsize"], r["key"])]
        entries.append({"itemsize": r["itemsize"], "key": list(r["key"]), "config": r["best"]["config"],
                        "gbps": round(r["best"]["gbps"])})
        mine[r["op"]] = sorted(entries, key=lambda e: (e["itemsize"], e["key"]))
        written += 1
    notes[device_name] = note
    path.write_text(
        '"""Launch configurations measured per GPU (written by ``benchmarks/sweep_kernels.py --write``).\n\n'
        '``TABLES[device name][op]`` is a list of ``{"itemsize", "key", "config", "gbps"}`` entries: the fastest\n'
        "configuration of ``op`` for inputs of that element size and ``key = (rows, *sizes)``, and the GB/s it\n"
        'reached; ``NOTES[device name]`` names the software and the run. A GPU without entries, or a shape\n'
        'without a near one, takes the launchers\' formulas.\n"""\n\n'
        f"TABLES: dict[str, dict[str, list[dict]]] = {_literal(tables)}\n\n"
        f"NOTES: dict[str, str] = {_literal(notes)}\n")
    return written


# ----------------------------------------------------------------------------- the command
def run_gpu(args, selected, device=None, timer=None) -> int:
    """Time ``selected`` on ``device`` (the tests pass a CPU device and a fake timer)."""
    from benchmarks import _gpu
    from benchmarks import _gpu_report as rep

    if device is None:
        if not torch.cuda.is_available():
            print("error: no CUDA device is visible (torch.cuda.is_available() is False); without a GPU, "
                  "--model prints the occupancy model of every candidate", file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    start = time.monotonic()
    model: dict = {}
    if device.type == "cuda" and args.jobs > 0:
        major, minor = torch.cuda.get_device_capability(device)
        key = next((k for k in ("h200", "h100") if k in torch.cuda.get_device_name(device).lower()), "h200")
        model = model_all(selected, args.dtype, args.small, f"cuda:{major}{minor}", key, args.jobs, args.compile_cap)
    timer = timer or _gpu.do_bench_timer(args.warmup_ms, args.rep_ms)
    copy = _gpu.measure_copy(device, timer, args.copy_bytes)
    env = rep.environment(device)
    header = rep.describe(env, copy) + f"; {args.dtype}"
    print(f"# {header}", flush=True)
    results, not_reached = [], []
    previous = signal.signal(signal.SIGTERM, _stop) if hasattr(signal, "SIGTERM") else None
    try:
        for i, case in selected:
            left = args.budget - (time.monotonic() - start)
            if left <= 0:
                not_reached.append(case.name)
                continue
            rows: list[dict] = []
            try:
                with _gpu.time_cap(min(args.case_cap, left)):
                    rows = time_case(case, device, timer, copy)
            except _gpu.CaseTimeout as exc:
                rows.append({"case": case.name, "cand": "-", "config": {}, "error": f"CaseTimeout: {exc}"})
            results.append(summarise(case, rows, {c: m for (j, c), m in model.items() if j == i}))
            b = results[-1]["best"]
            print(f"{case.name}: best {_fmt(b and b['config'])} {b['gbps']:,.0f} GB/s" if b else
                  f"{case.name}: nothing timed", flush=True)
            write_outputs(args.out, header, results, not_reached)  # a run cut short keeps every finished case
            if device.type == "cuda":
                torch.cuda.empty_cache()
    except (Stopped, KeyboardInterrupt) as exc:
        not_reached.append(f"(stopped: {exc or 'interrupted'})")
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        print("\n" + write_outputs(args.out, header, results, not_reached))
        if args.write and results:
            n = write_table(args.table, env["device"], header, results)
            print(f"wrote {n} entries for {env['device']} to {args.table}", file=sys.stderr)
    return 0 if results and all(r["best"] for r in results) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=sk.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-k", default="", help="only cases whose name contains this text (e.g. rms_norm.bwd, 4096)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--list", action="store_true", help="list the cases and their candidate counts")
    p.add_argument("--model", action="store_true", help="no GPU needed: compile every candidate for sm_90 and "
                   "print the occupancy model (apex.testing.occupancy)")
    p.add_argument("--device-model", default="h200", help="the GPU --model assumes (h200, h100)")
    p.add_argument("--budget", type=float, default=240.0, help="start no case after this many seconds")
    p.add_argument("--case-cap", type=float, default=45.0, help="stop one case after this many seconds")
    p.add_argument("--compile-cap", type=float, default=120.0, help="cap on the ahead-of-time compile phase")
    p.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                   help="processes compiling ahead (0: compile while timing)")
    p.add_argument("--warmup-ms", type=int, default=5)
    p.add_argument("--rep-ms", type=int, default=25)
    p.add_argument("--copy-bytes", type=int, default=1 << 30, help=argparse.SUPPRESS)
    p.add_argument("--small", action="store_true", help=argparse.SUPPRESS)  # tiny shapes, for the tests
    p.add_argument("--out", type=Path, default=sk.HERE / "results", help="folder for sweep.md and sweep.json")
    p.add_argument("--write", action="store_true", help="store the winners in the launchers' table")
    p.add_argument("--table", type=Path, default=sk.TABLE,
                   help="with --write: the table file to merge the winners into (default: apex/_kernels/_tuned.py; "
                        "on a machine whose checkout does not come back, a copy of it under the output folder)")
    args = p.parse_args(argv)
    os.environ["TRITON_INTERPRET"] = "0"  # before any kernel module is imported: compiled kernels only
    all_cases = sk.cases(DTYPES[args.dtype], sk.SMALL if args.small else None)
    selected = [(i, c) for i, c in enumerate(all_cases) if args.k in c.name]
    if args.list:
        for _, c in selected:
            print(f"{c.name}: {len(c.candidates)} candidates, {c.bytes_min / 1e6:,.0f} MB")
        return 0
    if args.model:
        model = model_all(selected, args.dtype, args.small, "cuda:90", args.device_model, args.jobs, args.compile_cap)
        text = model_table(selected, model)
        print(text)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "model.md").write_text(text + "\n")
        return 0 if model and not any("error" in m for m in model.values()) else 1
    return run_gpu(args, selected)
