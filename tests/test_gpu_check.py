""".ci/gpu_check.py checked without a GPU: its arguments and plan, the pytest / memcheck / benchmark parsing
its summary rests on, a phase stopped at its cap, the time limit, and a whole run on a CPU machine (every
phase skipped with the reason, exit status 2)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / ".ci" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


gc = _load()

SAMPLE_TESTS = textwrap.dedent("""
    import os, time, pytest

    @pytest.mark.parametrize("i", range(4))
    def test_fast(i):
        assert i != 2, "two"

    def test_skip():
        pytest.skip("a reason")

    @pytest.fixture
    def broken():
        raise RuntimeError("setup")

    def test_error(broken):
        pass

    def test_slow():
        time.sleep(float(os.environ.get("SLOW_S", "0")))
""")


def _pytest(tmp_path, *extra, env=None):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    out = subprocess.run([sys.executable, "-m", "pytest", "test_sample.py", "-p", "no:cacheprovider", "-vv", "-rfEs",
                          *extra], cwd=tmp_path, capture_output=True, text=True, env={**os.environ, **(env or {})},
                         timeout=300)
    return out.stdout + out.stderr


def test_arguments(monkeypatch, tmp_path):
    monkeypatch.delenv("OUT", raising=False)
    args = gc.parse_args([])
    assert args.phases == list(gc.CAPS) and args.outdir == ROOT / "gpu-check" and args.time_limit == 570
    assert args.pack is False
    monkeypatch.setenv("OUT", str(tmp_path / "o"))
    args = gc.parse_args([])
    assert args.outdir == tmp_path / "o" and args.pack is True  # $OUT, as the GPU machine sets it: packed
    assert gc.parse_args(["--no-pack"]).pack is False and gc.parse_args([str(tmp_path)]).pack is False
    args = gc.parse_args([str(tmp_path / "x"), "--phases", "bench, triton", "--scale", "0.5", "--jobs", "3"])
    assert args.outdir == tmp_path / "x" and args.phases == ["bench", "triton"] and args.jobs == 3
    for bad in (["--phases", "triton,gpu"], ["--phases", ","], ["--time-limit", "0"], ["--scale", "-1"],
                ["--jobs", "0"]):
        with pytest.raises(SystemExit) as e:
            gc.parse_args(bad)
        assert e.value.code == 2


def test_dry_run_prints_every_phase_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert gc.main([str(out), "--dry-run", "--jobs", "10"]) == 0
    text = capsys.readouterr().out
    for stage, phase in ((1, "triton"), (1, "distributed"), (2, "sanitizer"), (2, "upstream"), (3, "bench")):
        assert f"stage {stage}  {phase}" in text
    assert "APEX_TEST_DEVICE=cuda" in text and "-k 'triton or cuda_graph'" in text and "-n 10" in text
    assert "-m dist_device" in text
    assert "--tool memcheck" in text and "benchmarks/run.py --device cuda --budget 100" in text
    assert f"TRITON_CACHE_DIR={out}/cache/triton" in text
    assert not out.exists()


def test_plan_covers_every_kernel_test_file_once():
    files = gc.kernel_test_files()
    assert ROOT / "tests/ops/test_layer_norm.py" in files and ROOT / "tests/ops/test_multi_tensor_adam.py" in files
    kernels = {p.stem for p in (ROOT / "apex/_kernels").glob("[!_]*.py")}
    assert {f.stem.removeprefix("test_") for f in files} <= kernels
    plan = gc.build_plan(Path("/o"), {"cuda": True}, ["sanitizer"], 10)
    listed = [a for lane in plan[0].lanes for step in lane for a in step.argv if a.startswith("tests/ops/")]
    assert sorted(listed) == sorted(str(f.relative_to(ROOT)) for f in files) and len(plan[0].lanes) == 6


def test_no_gpu_skips_every_phase_with_the_reason(tmp_path):
    plan = gc.build_plan(tmp_path, {"cuda": False, "why": "torch.cuda.is_available() is False"}, list(gc.CAPS), 4)
    results = gc.Runner(tmp_path, {}, 600).run(plan)
    verdicts = [gc.judge(p.name, results[p.name]) for p in plan]
    assert all(v["status"].startswith("skipped: no CUDA device") for v in verdicts)
    assert gc.exit_status(verdicts) == 2


@pytest.mark.parametrize("xdist", [False, True], ids=["one process", "xdist"])
def test_summary_parses_pytest_output(tmp_path, xdist):
    text = _pytest(tmp_path, *(["-n", "2"] if xdist else []))
    p = gc.parse_pytest(text)
    assert p["finished"]
    assert p["counts"] == {"passed": 4, "failed": 1, "skipped": 1, "errors": 1}
    assert sorted(p["failures"]) == ["test_sample.py::test_error", "test_sample.py::test_fast[2]"]
    assert p["running"] == [] and p["crashed"] == []
    # Without pytest's final line (a killed run) the same counts come from the per-test lines.
    cut = "\n".join(ln for ln in text.splitlines() if " in " not in ln or "passed" not in ln)
    q = gc.parse_pytest(cut)
    assert not q["finished"] and q["counts"] == p["counts"]


def test_parse_names_crashed_and_running_tests():
    log = textwrap.dedent("""
        tests/a.py::test_one
        [gw0] [ 50%] PASSED tests/a.py::test_one
        tests/a.py::test_hangs
        tests/b.py::test_slow
        [gw1] node down: Not properly terminated
        replacing crashed worker gw1
        [gw1] [100%] FAILED tests/a.py::test_hangs
        worker 'gw1' crashed while running 'tests/a.py::test_hangs'
    """)
    p = gc.parse_pytest(log)
    assert p["crashed"] == ["tests/a.py::test_hangs"] and p["running"] == ["tests/b.py::test_slow"]
    assert not p["finished"] and p["counts"] == {"passed": 1, "failed": 1}


def test_memcheck_and_benchmark_parsing(tmp_path):
    assert gc.parse_memcheck("========= ERROR SUMMARY: 0 errors\n") == 0
    assert gc.parse_memcheck("========= ERROR SUMMARY: 3 errors\n=== ERROR SUMMARY: 1 error\n") == 4
    assert gc.parse_memcheck("========= Invalid __global__ read of size 4\n") is None
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"rows": [{"case": "a", "impl": "apex"}, {"case": "a", "impl": "torch"},
                                         {"case": "b", "impl": "apex", "error": "CaseTimeout"}],
                                "cpu_sized": [{"name": "c"}], "not_reached": ["d", "e"]}))
    assert gc.parse_bench(path) == {"rows": 4, "cases": 3, "errors": 1, "not_reached": 2}
    assert gc.parse_bench(tmp_path / "missing.json") is None


def test_a_phase_past_its_cap_is_reported_with_what_it_reached(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE_TESTS)
    argv = [sys.executable, "-m", "pytest", "test_sample.py", "-p", "no:cacheprovider", "-vv", "-rfEs"]
    slow = gc.Step("slow", argv, tmp_path / "slow.log", {"SLOW_S": "120"}, cwd=tmp_path)
    after = gc.Step("after", argv, tmp_path / "after.log", cwd=tmp_path)
    quick = gc.Step("quick", argv + ["-k", "fast"], tmp_path / "quick.log", cwd=tmp_path)
    phase = gc.Phase("capped", 15.0, [[slow, after], [quick]])
    start = time.monotonic()
    results = gc.Runner(tmp_path, {}, 600).run([phase])
    assert time.monotonic() - start < 15 + gc.GRACE_S + 10
    v = gc.judge("capped", results["capped"])
    assert v["status"] == "PAST ITS CAP (15 s)" and v["ok"] is False
    assert v["counts"]["passed"] == 3 + 3 and v["counts"]["failed"] == 1 + 1  # both lanes' counts
    assert "running when slow stopped: test_sample.py::test_slow" in v["notes"]
    assert "not reached: after" in v["notes"]
    assert "test_sample.py::test_fast[2]" in v["failures"]
    assert gc.exit_status([v]) == 1
    summary = gc.render([v], "a machine", tmp_path, 20, 600)
    assert "PAST ITS CAP (15 s)" in summary and "6 passed, 2 failed" in summary
    assert "capped: quick: 3 passed, 1 failed, 3 deselected" in summary  # one line per step


def test_a_failed_run_without_a_failed_test_says_why(tmp_path):
    said = "FAILED: the test run left new files in the repository: ['x']"
    step = gc.Step("t", [sys.executable, "-c", f"print('3 passed in 0.1s'); print({said!r}); raise SystemExit(1)"],
                   tmp_path / "t.log")
    results = gc.Runner(tmp_path, {}, 600).run([gc.Phase("p", 60.0, [[step]])])
    v = gc.judge("p", results["p"])
    assert v["status"] == "FAILED" and v["counts"] == {"passed": 3}
    assert v["notes"] == [f"t: exit status 1 without a failed test: {said}"]


def test_passing_phase_and_the_time_limit(tmp_path):
    ok = gc.Step("ok", [sys.executable, "-c", "import time; time.sleep(4); print('1 passed in 4.01s')"],
                 tmp_path / "ok.log")
    first = gc.Phase("first", 100.0, [[ok]], stage=1)
    later = gc.Phase("later", 100.0, [[gc.Step("x", [sys.executable, "-c", "pass"], tmp_path / "x.log")]], stage=2)
    # The limit leaves the first stage its minimum and nothing for the second.
    limit = gc.GRACE_S + gc.MIN_CAP_S + 3
    results = gc.Runner(tmp_path, {}, limit).run([first, later])
    v = gc.judge("first", results["first"])
    assert v["status"] == "passed" and v["counts"] == {"passed": 1} and abs(v["cap"] - gc.MIN_CAP_S - 3) < 1
    assert results["later"]["status"] == "not run" and "time limit" in results["later"]["why"]
    assert gc.exit_status([v, gc.judge("later", results["later"])]) == 0


def test_whole_check_on_a_cpu_machine(tmp_path):
    """No GPU here: the script still runs end to end, says why each phase did not run, exits 2; with $OUT
    (as on the GPU machine) the logs are packed, so three files come back."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "CUDA_VISIBLE_DEVICES")}
    env.update(CUDA_VISIBLE_DEVICES="", OUT=str(out))  # no GPU, even on a machine with one
    run = subprocess.run([sys.executable, str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 2, run.stdout + run.stderr
    summary = (out / "summary.md").read_text()
    assert run.stdout.rstrip().endswith(summary.rstrip())  # printed last
    for phase in gc.CAPS:
        assert f"{phase:<12} skipped " in summary
    assert summary.count("(no CUDA device (torch.cuda.is_available() is False))") == len(gc.CAPS)
    data = json.loads((out / "summary.json").read_text())
    assert data["machine"]["cuda"] is False and "torch" in data["machine"]
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.gz", "summary.json", "summary.md"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert "probe.json" in tar.getnames() and not any(n.startswith("cache") for n in tar.getnames())
