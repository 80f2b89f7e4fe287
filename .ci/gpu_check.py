#!/usr/bin/env python3
"""The GPU check: everything in this repository that needs a GPU, in at most 9.5 minutes on one H100/H200.

    python3 .ci/gpu_check.py [OUTDIR]            # the check; logs, summary.md and summary.json in OUTDIR
    python3 .ci/gpu_check.py --dry-run           # the plan: stages, commands, caps; runs nothing
    python3 .ci/gpu_check.py --export-upstream --mirror GIT_DIR   # NVIDIA Apex's tests into .upstream-tests/

It runs with the machine's own torch and triton and needs no network: the children get
``PYTHONPATH=<repo>:<repo>/apex/_compat``, nothing is installed. OUTDIR defaults to ``$OUT`` (where the
logs end up packed in OUTDIR/logs.tar.gz beside the summary: ``--pack``), else ``gpu-check/`` (ignored by
git). Compiled kernels are cached in OUTDIR/cache (``TRITON_CACHE_DIR``, ``TORCHINDUCTOR_CACHE_DIR``) so
later phases reuse the earlier ones' compiles; it is removed at the end unless ``--keep-cache``.

Phases run in stages: the phases of a stage side by side (16 cores), the stages one after another; the
benchmarks alone, since they time. Each phase has a cap: at the cap its processes are interrupted (pytest
then prints the counts it reached), killed 15 s later, and the phase is reported as past its cap, with the
tests that were running and the steps never started. ``--time-limit`` bounds the whole run: a stage's caps
shrink to the time left.

  stage 1  triton       APEX_TEST_DEVICE=cuda pytest tests -k 'triton or cuda_graph' -n JOBS (CPUs - 4)  cap 180 s
           distributed  APEX_TEST_DEVICE=cuda pytest tests -m dist_device -n 2              cap 180 s
  stage 2  sanitizer    compute-sanitizer memcheck, tests/ops/test_<kernel>.py -k triton, 6 processes  cap 150 s
           upstream     NVIDIA Apex's tests/L0 and one-GPU contrib folders, natively, 6 lanes        cap 200 s
  stage 3  bench        benchmarks/run.py --device cuda, its budget 30 s under the cap              cap 130 s

The summary (printed last, also OUTDIR/summary.md) has one row per phase: the result, pytest's counts (from
its final line, or counted from the per-test lines of a run that did not finish), time against cap, and the
log. Exit status: 0 when every phase passed, 1 when one failed or went past its cap, 2 when nothing could
run (no GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UPSTREAM = ROOT / ".upstream-tests"
UPSTREAM_COMMIT = "e13873de"
# Apex's own suites that need one GPU: tests/L0 folders, then apex/contrib/test packages, with a rough
# weight (relative run time) to spread them over the lanes.
UPSTREAM_FOLDERS = {
    "tests/L0/run_fused_layer_norm": 3, "tests/L0/run_amp": 2, "tests/L0/run_optimizers": 1.5,
    "tests/L0/run_mlp": 1, "apex/contrib/test/xentropy": 2, "apex/contrib/test/multihead_attn": 2,
    "apex/contrib/test/transducer": 1, "apex/contrib/test/fused_dense": 1, "apex/contrib/test/group_norm": 1,
    "apex/contrib/test/conv_bias_relu": 1, "apex/contrib/test/layer_norm": 1, "apex/contrib/test/fmha": 1,
    "apex/contrib/test/openfold_triton": 1, "apex/contrib/test/focal_loss": 0.5,
    "apex/contrib/test/index_mul_2d": 0.5, "apex/contrib/test/clip_grad": 0.5,
}
# The Triton-path tests, and the CUDA-graph capture of the capturable optimizers (named apart: it needs CUDA,
# not the Triton backend's switch).
TRITON_SELECT = "triton or cuda_graph"
# Measured on an H200 (16 CPUs): triton 140 s, distributed 112 s, sanitizer 58 s; upstream did not finish in
# 150 s (run_fused_layer_norm alone takes longer), so stage 2 gets the time stage 1 did not need.
CAPS = {"triton": 180.0, "distributed": 180.0, "sanitizer": 150.0, "upstream": 200.0, "bench": 130.0}
UPSTREAM_LANES = 6
SANITIZER_LANES = 6
STAGES = {"triton": 1, "distributed": 1, "sanitizer": 2, "upstream": 2, "bench": 3}
GRACE_S = 15.0  # after the interrupt, before the kill
MIN_CAP_S = 20.0  # a phase with less time than this left is not started


@dataclass
class Step:
    """One process: a pytest run, a sanitizer run or the benchmarks; its output goes to ``log``."""

    name: str
    argv: list[str]
    log: Path
    env: dict = field(default_factory=dict)
    cwd: Path = ROOT
    kind: str = "pytest"  # pytest | sanitizer | bench
    stop: int = signal.SIGINT  # sent at the cap: pytest prints its counts on an interrupt
    memcheck_log: Path | None = None
    bench_json: Path | None = None


@dataclass
class Phase:
    """Lanes run side by side, the steps of a lane one after another, all under the phase's cap."""

    name: str
    cap: float
    lanes: list[list[Step]]
    stage: int = 1
    skip: str = ""  # why the phase cannot run here


@dataclass
class StepResult:
    step: Step
    rc: int | None = None  # None: never started
    seconds: float = 0.0
    capped: bool = False


# ---------------------------------------------------------------------------------------------- parsing

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|rerun)\b")
_FINAL = re.compile(r"(?:\d+ \w+.*|no tests ran) in [\d.]+s")
_XDIST_OUTCOME = re.compile(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (\S+::\S.*?)"
                            r"(?: \(.*\))?\s*$")  # a skip's or xfail's reason in parentheses
_PLAIN_OUTCOME = re.compile(r"^(\S+::\S.*?) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)(?: \(.*\))?"
                            r"(?:\s+\[\s*\d+%\])?\s*$")
_STARTED = re.compile(r"^(\S+\.py::\S.*?)\s*$")
_SHORT = re.compile(r"^(FAILED|ERROR) (\S.*?)(?: - .*)?$")
_CRASHED = re.compile(r"worker '?gw\d+'? crashed while running '?([^'\s]+)'?")
_OUTCOME_KEY = {"PASSED": "passed", "FAILED": "failed", "SKIPPED": "skipped", "ERROR": "errors",
                "XFAIL": "xfailed", "XPASS": "xpassed"}


def parse_pytest(text: str) -> dict:
    """Counts, failures, crashes and the tests still running, from a pytest log (``-vv``, ``-rfE``).

    ``counts`` come from pytest's final line when it printed one (``finished`` True), else from the
    per-test outcome lines (a run killed before its summary). ``running``: tests that started and have no
    outcome (those a cap interrupted, or a hang).
    """
    lines = text.splitlines()
    final = next((ln for ln in reversed(lines) if _FINAL.search(ln) and ("passed" in ln or "failed" in ln
                                                                       or "no tests ran" in ln or "skipped" in ln
                                                                       or "error" in ln)), None)
    counted: dict[str, int] = {}
    outcomes: dict[str, str] = {}
    started: list[str] = []
    for ln in lines:
        m = _XDIST_OUTCOME.match(ln)
        if m:
            outcomes[m.group(2)] = m.group(1)
            continue
        m = _PLAIN_OUTCOME.match(ln)
        if m:
            outcomes[m.group(1)] = m.group(2)
            continue
        m = _STARTED.match(ln)
        if m:
            started.append(m.group(1))
    for outcome in outcomes.values():
        key = _OUTCOME_KEY[outcome]
        counted[key] = counted.get(key, 0) + 1
    counts: dict[str, int] = {}
    if final is not None:
        for n, word in _COUNT.findall(final):
            counts["errors" if word.startswith("error") else word] = int(n)
    failures = []
    for ln in lines:
        m = _SHORT.match(ln)
        if m and m.group(2) not in failures:
            failures.append(m.group(2))
    if not failures:  # no short summary (killed): the outcome lines
        failures = [t for t, o in outcomes.items() if o in ("FAILED", "ERROR")]
    crashed = list(dict.fromkeys(_CRASHED.findall(text)))
    running = [t for t in dict.fromkeys(started) if t not in outcomes and t not in crashed]
    # A single-process verbose run prints the test id, then its outcome on the same line: a last line
    # holding a test id alone is the test that was running.
    if lines and _STARTED.match(lines[-1]) and lines[-1].strip() not in running:
        running.append(lines[-1].strip())
    return {"finished": final is not None, "counts": counts if final is not None else counted,
            "failures": failures, "crashed": crashed, "running": running}


def parse_memcheck(text: str) -> int | None:
    """The memcheck error count of a compute-sanitizer log (None when it printed no summary)."""
    found = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
    return sum(int(n) for n in found) if found else None


def parse_bench(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rows = list(data.get("rows", [])) + list(data.get("cpu_sized", []))
    return {"rows": len(rows), "cases": len({r.get("case", r.get("name")) for r in rows}),
            "errors": sum(1 for r in rows if r.get("error")), "not_reached": len(data.get("not_reached", []))}


# ------------------------------------------------------------------------------------------------ the plan

def child_env(out: Path) -> dict:
    """What every phase runs with: this checkout on the path (nothing installed), compile caches under OUT."""
    path = [str(ROOT), str(ROOT / "apex" / "_compat")]
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    return {"PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg",
            "TRITON_CACHE_DIR": str(out / "cache" / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(out / "cache" / "inductor")}


def pytest_args(timeout: float, method: str, probe: dict) -> list[str]:
    """Verbose per-test lines (so a killed run still shows what finished), failures and skips summarised,
    the slowest tests listed, and a per-test timeout shorter than the cap (a hang is named, not hidden)."""
    args = ["-p", "no:cacheprovider", "-vv", "-rfEs", "--durations=15"]
    if probe.get("pytest_timeout", True):
        args += ["--timeout", str(int(timeout)), "-o", f"timeout_method={method}"]
    return args


def _lanes(weighted: dict, n: int) -> list[list]:
    lanes: list[list] = [[] for _ in range(n)]
    load = [0.0] * n
    for item, weight in sorted(weighted.items(), key=lambda kv: -kv[1]):
        i = load.index(min(load))
        lanes[i].append(item)
        load[i] += weight
    return [lane for lane in lanes if lane]


def kernel_test_files() -> list[Path]:
    """tests/ops/test_<op>.py of every Triton kernel module apex/_kernels/<op>.py (contributing.md's rule)."""
    ops = sorted(p.stem for p in (ROOT / "apex" / "_kernels").glob("*.py") if not p.stem.startswith("_"))
    return [f for f in (ROOT / "tests" / "ops" / f"test_{op}.py" for op in ops) if f.exists()]


def count_tests(files: list[Path], env: dict) -> dict[str, int]:
    """Tests per file that ``-k triton`` selects (a collection on the CPU: the cases are the same), to spread
    the files evenly over the sanitizer's processes; file sizes stand in when the collection fails."""
    rel = [str(f.relative_to(ROOT)) for f in files]
    counts = {r: 0 for r in rel}
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p",
                              "no:cacheprovider", *rel, "-k", "triton"], cwd=ROOT, capture_output=True, text=True,
                             timeout=180, env={**os.environ, **env, "APEX_TEST_DEVICE": "cpu"})
        for line in run.stdout.splitlines():
            m = re.match(r"^(\S+\.py)(?::: ?|: )(\d+)?", line)
            if m and m.group(1) in counts:
                counts[m.group(1)] += int(m.group(2)) if m.group(2) else 1
    except (subprocess.SubprocessError, OSError):
        pass
    if not any(counts.values()):
        return {str(f.relative_to(ROOT)): f.stat().st_size for f in files}
    return counts


def sanitizer_path() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.access(p, os.X_OK)), None)


def build_plan(out: Path, probe: dict, phases: list[str], jobs: int, scale: float = 1.0,
               weights: dict[str, int] | None = None) -> list[Phase]:
    """The phases to run; ``weights``: the sanitizer's tests per kernel test file (file sizes if not given)."""
    py = sys.executable
    gpu = "" if probe.get("cuda") else f"no CUDA device ({probe.get('why', 'torch.cuda.is_available() is False')})"
    xdist = probe.get("xdist", True)
    plan = []
    if "triton" in phases:
        n = ["-n", str(jobs)] if xdist else []
        argv = [py, "-m", "pytest", "tests", "-k", TRITON_SELECT, "-m", "not dist_device", *n,
                *pytest_args(120, "thread", probe)]
        plan.append(Phase("triton", CAPS["triton"] * scale, [[Step("triton", argv, out / "triton.log",
                                                                   {"APEX_TEST_DEVICE": "cuda"})]], skip=gpu))
    if "distributed" in phases:
        n = ["-n", "2"] if xdist else []
        argv = [py, "-m", "pytest", "tests", "-m", "dist_device", *n, *pytest_args(150, "thread", probe)]
        plan.append(Phase("distributed", CAPS["distributed"] * scale,
                          [[Step("distributed", argv, out / "distributed.log", {"APEX_TEST_DEVICE": "cuda"})]],
                          skip=gpu))
    if "sanitizer" in phases:
        tool = sanitizer_path()
        files = kernel_test_files()
        weights = weights or {str(f.relative_to(ROOT)): f.stat().st_size for f in files}
        groups = _lanes({str(f.relative_to(ROOT)): weights.get(str(f.relative_to(ROOT)), 1) for f in files},
                        SANITIZER_LANES)
        lanes = []
        for i, group in enumerate(groups, 1):
            mlog = out / f"sanitizer-{i}.memcheck.log"
            argv = [tool or "compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "86", "--print-limit",
                    "100", "--log-file", str(mlog),
                    py, "-m", "pytest", *sorted(group), "-k", "triton", "-p", "no:xdist",
                    *pytest_args(150, "signal", probe)]
            # Without PyTorch's caching allocator every tensor is its own allocation, so memcheck sees a
            # read past a tensor's end (inside a cached block it would be another tensor's memory).
            env = {"APEX_TEST_DEVICE": "cuda", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
            lanes.append([Step(f"sanitizer {i}/{len(groups)}", argv, out / f"sanitizer-{i}.log", env,
                               kind="sanitizer", memcheck_log=mlog)])
        skip = gpu or ("" if tool else "compute-sanitizer not found (PATH, /usr/local/cuda/bin)")
        plan.append(Phase("sanitizer", CAPS["sanitizer"] * scale, lanes, skip=skip))
    if "upstream" in phases:
        folders = [f for f in UPSTREAM_FOLDERS if (UPSTREAM / f).is_dir()]
        lanes = []
        for lane in _lanes({f: UPSTREAM_FOLDERS[f] for f in folders}, UPSTREAM_LANES):
            steps = []
            for folder in lane:
                argv = [py, "-m", "pytest", "--continue-on-collection-errors", "-o", "pythonpath=.",
                        *pytest_args(90, "signal", probe), "."]
                env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "apex" / "_compat"),
                                                      str(UPSTREAM / "site")]),
                       "PYTHONHASHSEED": "0", "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": "60",
                       "PYTORCH_PRINT_REPRO_ON_FAILURE": "0"}
                name = folder.split("/")[-1] if folder.startswith("tests/") else "contrib/" + folder.split("/")[-1]
                steps.append(Step(name, argv, out / "upstream" / (name.replace("/", "-") + ".log"), env,
                                  cwd=UPSTREAM / folder))
            lanes.append(steps)
        skip = gpu or ("" if folders else f"{UPSTREAM.name}/ is missing: export it where NVIDIA Apex's git is "
                                          "(python3 .ci/gpu_check.py --export-upstream --mirror GIT_DIR) and "
                                          "carry it along")
        plan.append(Phase("upstream", CAPS["upstream"] * scale, lanes, skip=skip))
    if "bench" in phases:
        cap = CAPS["bench"] * scale
        argv = [py, "benchmarks/run.py", "--device", "cuda", "--budget", str(max(10, int(cap - 30))),
                "--out", str(out / "bench")]
        plan.append(Phase("bench", cap, [[Step("bench", argv, out / "bench.log", kind="bench", stop=signal.SIGTERM,
                                               bench_json=out / "bench" / "gpu.json")]], skip=gpu))
    for phase in plan:
        phase.stage = STAGES.get(phase.name, phase.stage)
    return plan


# ------------------------------------------------------------------------------------------------- running

class Runner:
    """Runs a plan's stages; at a phase's cap (or when this process is asked to stop) interrupts its steps."""

    def __init__(self, out: Path, base_env: dict, time_limit: float, poll: float = 0.25):
        self.out, self.base_env, self.time_limit, self.poll = out, base_env, time_limit, poll
        self.start = time.monotonic()
        self.stopping = False

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def run(self, plan: list[Phase]) -> dict[str, dict]:
        results: dict[str, dict] = {}
        for stage in sorted({p.stage for p in plan}):
            phases = [p for p in plan if p.stage == stage]
            left = self.time_limit - self.elapsed() - GRACE_S
            runnable = []
            for p in phases:
                cap = min(p.cap, left)
                if p.skip:
                    results[p.name] = {"status": "skipped", "why": p.skip, "cap": p.cap, "steps": []}
                elif self.stopping or left < MIN_CAP_S:
                    why = "the check was stopped" if self.stopping else f"{max(left, 0):.0f} s of the time limit left"
                    results[p.name] = {"status": "not run", "why": why, "cap": p.cap, "steps": []}
                else:
                    runnable.append((p, cap))
            results.update(self._run_stage(runnable))
        return results

    def _launch(self, step: Step) -> tuple[subprocess.Popen, object]:
        step.log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.base_env, **step.env}
        f = open(step.log, "w")
        f.write(f"$ cd {step.cwd} && {' '.join(f'{k}={shlex.quote(v)}' for k, v in step.env.items())} "
                f"{shlex.join(step.argv)}\n\n")
        f.flush()
        proc = subprocess.Popen(step.argv, cwd=step.cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        return proc, f

    def _run_stage(self, runnable: list[tuple[Phase, float]]) -> dict[str, dict]:
        state = {}
        for phase, cap in runnable:
            print(f"[{self.elapsed():5.0f} s] {phase.name}: started (cap {cap:.0f} s)", flush=True)
            t0 = time.monotonic()
            state[phase.name] = {"phase": phase, "cap": cap, "t0": t0, "end": t0, "running": {}, "done": [],
                                 "lanes": [list(lane) for lane in phase.lanes], "capped": False, "killed_at": None}
            for i in range(len(phase.lanes)):
                self._next(state[phase.name], i)
        while any(s["running"] for s in state.values()):
            time.sleep(self.poll)
            now = time.monotonic()
            for s in state.values():
                for i, (step, proc, f, t0) in list(s["running"].items()):
                    rc = proc.poll()
                    if rc is None:
                        continue
                    f.close()
                    s["done"].append(StepResult(step, rc, now - t0, capped=s["capped"]))
                    s["end"] = now
                    del s["running"][i]
                    if not s["capped"] and now - s["t0"] < s["cap"] and not self.stopping:
                        self._next(s, i)
                over = now - s["t0"] >= s["cap"] or self.stopping
                if over and not s["capped"] and s["running"]:
                    s["capped"], s["killed_at"] = True, now
                    print(f"[{self.elapsed():5.0f} s] {s['phase'].name}: at its cap, interrupting", flush=True)
                    for step, proc, _, _ in s["running"].values():
                        _signal_group(proc, step.stop)
                elif s["capped"] and s["running"] and now - s["killed_at"] >= GRACE_S:
                    for _, proc, _, _ in s["running"].values():
                        _signal_group(proc, signal.SIGKILL)
        out = {}
        for name, s in state.items():
            never = [StepResult(step) for lane in s["lanes"] for step in lane]
            out[name] = {"cap": s["cap"], "seconds": s["end"] - s["t0"], "capped": s["capped"],
                         "steps": s["done"] + never}
            print(f"[{self.elapsed():5.0f} s] {name}: finished", flush=True)
        return out

    def _next(self, s: dict, lane: int) -> None:
        if s["lanes"][lane]:
            step = s["lanes"][lane].pop(0)
            if "--budget" in step.argv:  # the benchmarks stop starting cases 30 s before the phase's cap
                left = s["cap"] - (time.monotonic() - s["t0"])
                step.argv[step.argv.index("--budget") + 1] = str(max(10, int(left - 30)))
            proc, f = self._launch(step)
            s["running"][lane] = (step, proc, f, time.monotonic())


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------------------------- summary

def judge(name: str, res: dict) -> dict:
    """Status, counts and notes of one phase from its steps' exit codes and logs."""
    if res.get("status") in ("skipped", "not run"):
        return {"phase": name, "status": f"{res['status']}: {res['why']}", "ok": None, "counts": {},
                "failures": [], "notes": [], "details": [], "seconds": 0, "cap": res["cap"], "logs": []}
    counts: dict[str, int] = {}
    failures, notes, logs, details = [], [], [], []
    bad = False
    for r in res["steps"]:
        step = r.step
        if r.rc is None:
            notes.append(f"not reached: {step.name}")
            continue
        logs.append(str(step.log))
        text = step.log.read_text(errors="replace") if step.log.exists() else ""
        if step.kind in ("pytest", "sanitizer"):
            p = parse_pytest(text)
            for k, v in p["counts"].items():
                counts[k] = counts.get(k, 0) + v
            failures += [t for t in p["failures"] if t not in p["crashed"]]
            failures += [f"{t} (its worker crashed: a per-test timeout or a fatal error)" for t in p["crashed"]]
            if p["running"]:
                notes.append(f"running when {step.name} stopped: " + ", ".join(p["running"][:5])
                             + (f" and {len(p['running']) - 5} more" if len(p["running"]) > 5 else ""))
            if not p["finished"]:
                notes.append(f"{step.name}: pytest printed no final counts (counted from its per-test lines)")
            if len(res["steps"]) > 1:
                details.append(f"{step.name}: {_fmt_counts(p['counts'])} ({r.seconds:.0f} s, exit {r.rc})")
            if r.rc not in (0, 2) or (r.rc == 2 and not r.capped) or p["counts"].get("failed") or \
                    p["counts"].get("errors") or p["crashed"]:
                bad = True
                if r.rc not in (0, 1, 2):
                    notes.append(f"{step.name}: exit status {r.rc}" + (" (no tests collected)" if r.rc == 5 else ""))
                elif not p["failures"] and not p["crashed"] and not p["counts"].get("failed"):
                    # failed without a failed test (a conftest's session check, an internal error): say why
                    said = [ln.strip() for ln in text.splitlines()
                            if ln.startswith(("FAILED:", "ERROR:", "INTERNALERROR"))]
                    notes.append(f"{step.name}: exit status {r.rc} without a failed test"
                                 + (f": {said[-1][:200]}" if said else " (see its log)"))
        if step.kind == "sanitizer":
            mtext = step.memcheck_log.read_text(errors="replace") if step.memcheck_log and \
                step.memcheck_log.exists() else ""
            errors = parse_memcheck(mtext)
            logs.append(str(step.memcheck_log))
            if errors is None:
                notes.append(f"{step.name}: no memcheck summary (stopped before the end)")
            else:
                counts["memcheck errors"] = counts.get("memcheck errors", 0) + errors
                bad = bad or errors > 0
        if step.kind == "bench":
            b = parse_bench(step.bench_json) if step.bench_json else None
            if b is None:
                notes.append("no gpu.json written")
                bad = True
            else:
                counts.update({"rows": b["rows"], "cases": b["cases"], "row errors": b["errors"],
                               "not reached": b["not_reached"]})
                logs.append(str(step.bench_json.with_suffix(".md")))
            bad = bad or r.rc != 0
    if res["capped"] or any(r.rc is None for r in res["steps"]):
        status, ok = f"PAST ITS CAP ({res['cap']:.0f} s)", False
    elif bad:
        status, ok = "FAILED", False
    else:
        status, ok = "passed", True
    return {"phase": name, "status": status, "ok": ok, "counts": counts, "failures": failures, "notes": notes,
            "details": details, "seconds": res["seconds"], "cap": res["cap"], "logs": logs}


def _fmt_counts(counts: dict) -> str:
    order = ["passed", "failed", "errors", "skipped", "xfailed", "xpassed", "deselected", "memcheck errors",
             "cases", "rows", "row errors", "not reached"]
    return ", ".join(f"{counts[k]} {k}" for k in order if k in counts) or "-"


def render(verdicts: list[dict], header: str, out: Path, total: float, limit: float) -> str:
    lines = [f"GPU check: {header}", "",
             f"{'phase':<12} {'result':<28} {'time / cap':<13} counts"]
    for v in verdicts:
        if v["ok"] is None:  # skipped or not run: the reason below
            head, _, why = v["status"].partition(": ")
            lines.append(f"{v['phase']:<12} {head:<28} {'-':<13} -")
            lines.append(f"{'':<12} ({why})")
            continue
        t = f"{v['seconds']:.0f} / {v['cap']:.0f} s"
        lines.append(f"{v['phase']:<12} {v['status']:<28} {t:<13} {_fmt_counts(v['counts'])}")
    for v in verdicts:
        for d in v["details"]:
            lines.append(f"  {v['phase']}: {d}")
    for v in verdicts:
        for f in v["failures"][:25]:
            lines.append(f"  {v['phase']}: FAILED {f}")
        if len(v["failures"]) > 25:
            lines.append(f"  {v['phase']}: ... {len(v['failures']) - 25} more in its log")
        for n in v["notes"]:
            lines.append(f"  {v['phase']}: {n}")
    lines += ["", f"total {total:.0f} s (time limit {limit:.0f} s); logs in {out}"]
    return "\n".join(lines)


def exit_status(verdicts: list[dict]) -> int:
    ran = [v for v in verdicts if v["ok"] is not None]
    if not ran:
        return 2
    return 0 if all(v["ok"] for v in ran) else 1


# --------------------------------------------------------------------------------------------- environment

PROBE = r"""
import importlib.util, json, sys
info = {"python": sys.version.split()[0]}
info["xdist"] = importlib.util.find_spec("xdist") is not None
info["pytest_timeout"] = importlib.util.find_spec("pytest_timeout") is not None
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda"] = bool(torch.cuda.is_available())
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["devices"] = torch.cuda.device_count()
        info["cuda_runtime"] = torch.version.cuda
    else:
        info["why"] = "torch.cuda.is_available() is False"
except Exception as e:
    info["cuda"], info["why"] = False, f"torch does not import: {type(e).__name__}: {e}"
try:
    import triton
    info["triton"] = triton.__version__
except Exception as e:
    info["triton"] = f"not importable ({type(e).__name__})"
print(json.dumps(info))
"""


def probe_machine(env: dict) -> dict:
    try:
        out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
                             text=True, timeout=180, cwd=ROOT)
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as e:
        info = {"cuda": False, "why": f"the probe failed: {type(e).__name__}"}
    if shutil.which("nvidia-smi"):
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            info["driver"] = smi.stdout.strip().splitlines()[0] if smi.stdout.strip() else "?"
        except (subprocess.SubprocessError, OSError):
            pass
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        if rev.returncode == 0:
            info["commit"] = rev.stdout.strip() + (" + local changes" if dirty.stdout.strip() else "")
    except (subprocess.SubprocessError, OSError):
        pass
    info["cpus"] = os.cpu_count()
    return info


def describe(info: dict) -> str:
    where = f"{info['device']} x{info.get('devices', 1)}" if info.get("cuda") else f"no GPU ({info.get('why')})"
    parts = [where, f"driver {info['driver']}" if info.get("driver") else "",
             f"torch {info.get('torch', '?')}", f"triton {info.get('triton', '?')}",
             f"commit {info['commit']}" if info.get("commit") else "", f"{info.get('cpus')} CPUs"]
    return ", ".join(p for p in parts if p)


# -------------------------------------------------------------------------------------------------- export

def export_upstream(mirror: str, commit: str, dest: Path = UPSTREAM) -> None:
    """NVIDIA Apex's test sources at ``commit`` (``tests/L0``, ``apex/contrib/test``) into ``dest``, with an
    empty ``pytest.ini`` per suite folder (each runs as its own rootdir, as in a scratch folder) and
    ``site/`` holding expecttest (pure Python, which torch.testing._internal imports) from this environment,
    so that the GPU machine, without network, needs nothing else."""
    if not mirror:
        raise SystemExit("--export-upstream needs --mirror GIT_DIR (a clone of NVIDIA/apex; APEX_UPSTREAM_GIT)")
    if subprocess.run(["git", "--git-dir", mirror, "cat-file", "-e", f"{commit}^{{commit}}"]).returncode:
        raise SystemExit(f"{mirror} has no commit {commit}")
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "--git-dir", mirror, "archive", commit, "tests/L0", "apex/contrib/test"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    for folder in UPSTREAM_FOLDERS:
        ini = dest / folder / "pytest.ini"
        if (dest / folder).is_dir() and not ini.exists():
            ini.write_text("[pytest]\n")
    spec = importlib.util.find_spec("expecttest")
    if spec is not None and spec.origin:
        shutil.copytree(Path(spec.origin).parent, dest / "site" / "expecttest",
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        print("warning: expecttest is not installed here; the GPU machine must have it", file=sys.stderr)
    (dest / "COMMIT").write_text(commit + "\n")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"exported NVIDIA Apex {commit} tests to {dest} ({size / 2**20:.1f} MiB); carry it to the GPU run")


# ---------------------------------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("outdir", nargs="?", type=Path,
                   help="where logs and the summary go (default: $OUT, else gpu-check/ in the repository)")
    p.add_argument("--phases", default=",".join(CAPS),
                   help=f"comma-separated subset of {','.join(CAPS)} (default: all)")
    p.add_argument("--time-limit", type=float, default=570.0,
                   help="seconds for the whole check; a stage's caps shrink to what is left (default 570)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every phase's cap (default 1)")
    p.add_argument("--jobs", type=int, default=None,
                   help="pytest-xdist workers of the triton phase (default: CPUs - 4, at least 2)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    p.add_argument("--keep-cache", action="store_true", help="keep OUTDIR/cache (the compiled kernels)")
    p.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None,
                   help="at the end, pack the logs into OUTDIR/logs.tar.gz beside summary.md and summary.json "
                        "(default: when OUTDIR comes from $OUT)")
    p.add_argument("--export-upstream", action="store_true",
                   help=f"write NVIDIA Apex's test sources to {UPSTREAM.name}/ and exit (needs --mirror)")
    p.add_argument("--mirror", default=os.environ.get("APEX_UPSTREAM_GIT", ""),
                   help="git dir of NVIDIA/apex for --export-upstream (default: $APEX_UPSTREAM_GIT)")
    p.add_argument("--commit", default=UPSTREAM_COMMIT, help=f"upstream commit to export (default {UPSTREAM_COMMIT})")
    args = p.parse_args(argv)
    args.phases = [s.strip() for s in args.phases.split(",") if s.strip()]
    unknown = [s for s in args.phases if s not in CAPS]
    if unknown or not args.phases:
        p.error(f"--phases: unknown phase(s) {unknown}; choose from {', '.join(CAPS)}")
    if args.time_limit <= 0 or args.scale <= 0:
        p.error("--time-limit and --scale must be positive")
    if args.jobs is not None and args.jobs < 1:
        p.error("--jobs must be at least 1")
    from_env = args.outdir is None and bool(os.environ.get("OUT"))
    if args.outdir is None:
        args.outdir = Path(os.environ["OUT"]) if from_env else ROOT / "gpu-check"
    args.outdir = args.outdir.resolve()
    if args.pack is None:
        args.pack = from_env
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.export_upstream:
        export_upstream(args.mirror, args.commit)
        return 0
    out: Path = args.outdir
    jobs = args.jobs or max(2, (os.cpu_count() or 8) - 4)
    env = child_env(out)
    if args.dry_run:
        plan = build_plan(out, {"cuda": True}, args.phases, jobs, args.scale)
        print(f"plan (time limit {args.time_limit:.0f} s; logs in {out}; every step also gets "
              + " ".join(f"{k}={v}" for k, v in env.items()) + ")")
        for phase in plan:
            print(f"stage {phase.stage}  {phase.name}  cap {phase.cap:.0f} s" + (f"  [{phase.skip}]" if phase.skip
                                                                                   else ""))
            for i, lane in enumerate(phase.lanes, 1):
                for step in lane:
                    extra = " ".join(f"{k}={shlex.quote(v)}" for k, v in step.env.items())
                    where = "" if step.cwd == ROOT else f"cd {step.cwd.relative_to(ROOT)} && "
                    print(f"  lane {i}: {where}{extra} {shlex.join(step.argv)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(out, env, args.time_limit)

    def stop(signum, frame):  # an outer timeout: interrupt the phases and still write the summary
        runner.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    info = probe_machine(env)
    (out / "probe.json").write_text(json.dumps(info, indent=1))
    header = describe(info)
    print(f"GPU check: {header}", flush=True)
    weights = count_tests(kernel_test_files(), env) if "sanitizer" in args.phases and info.get("cuda") else None
    plan = build_plan(out, info, args.phases, jobs, args.scale, weights)
    try:
        results = runner.run(plan)
    finally:
        if not args.keep_cache:
            shutil.rmtree(out / "cache", ignore_errors=True)
    verdicts = [judge(p.name, results[p.name]) for p in plan]
    text = render(verdicts, header, out / "logs.tar.gz" if args.pack else out, runner.elapsed(), args.time_limit)
    (out / "summary.md").write_text(text + "\n")
    (out / "summary.json").write_text(json.dumps({"machine": info, "phases": verdicts}, indent=1, default=str))
    if args.pack:
        pack_logs(out)
    print("\n" + text, flush=True)
    return exit_status(verdicts)


KEEP = ("summary.md", "summary.json", "logs.tar.gz")


def pack_logs(out: Path) -> None:
    """Everything in ``out`` but the summaries into ``out/logs.tar.gz``, then removed: three files to copy
    back from the GPU machine instead of dozens."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        for path in sorted(out.iterdir()):
            if path.name not in KEEP:
                tar.add(path, arcname=path.name)
    for path in out.iterdir():
        if path.name not in KEEP:
            shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    sys.exit(main())
