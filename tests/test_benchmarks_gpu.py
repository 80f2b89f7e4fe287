"""``benchmarks/run.py --device cuda`` without a GPU: the refusal, the case list and its byte formulas, and
the runner's GPU code path run on small CPU tensors with a fake timer."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

import apex
from benchmarks import _gpu, run
from benchmarks.ops import (
    bench_bias_swiglu,
    bench_fused_rope,
    bench_layer_norm,
    bench_rms_norm,
    bench_scaled_masked_softmax,
    bench_xentropy,
)
from benchmarks.optimizers import _gpu_adam

MB = 10**6
ISSUE_SHAPES = {  # the shapes the GPU benchmark must measure, in both half-precision dtypes
    "layer_norm": ["16384x4096", "65536x1024", "32768x2048", "8192x8192", "4096x16384"],
    "rms_norm": ["16384x4096", "65536x1024", "32768x2048", "8192x8192", "4096x16384"],
    "softmax_causal": ["1x128x2048x2048"], "rope_sbhd": ["4096x4x32x128"], "bias_swiglu": ["16384x16384"],
}


def fake_timer(ms=0.5):
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return ms
    timer.calls = calls
    return timer


def _args(tmp_path, **kw):
    base = dict(k="", quick=False, cpu_cases=False, no_compile=False, compile_backend="eager", budget=600.0,
                case_cap=0.0, copy_bytes=1 << 12, out=tmp_path, json=None, kernels=False)
    base.update(kw)
    return SimpleNamespace(**base)


def test_cuda_without_gpu_exits_with_a_clear_message(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))  # main() sets it: restore
    assert run.main(["--device", "cuda", "--quick"]) == 2
    assert "--device cuda: no CUDA device is visible" in capsys.readouterr().err


def test_case_list_covers_the_shapes_modes_and_dtypes():
    gpu, small = run.cuda_plan()
    names = [c.name for c in gpu]
    assert len(names) == len(set(names))
    for op, shapes in ISSUE_SHAPES.items():
        for shape in shapes:
            for dt in ("bf16", "fp16"):
                for mode in ("fwd", "bwd"):
                    assert f"{op} {mode} {shape} {dt}" in names
    assert {"cross_entropy fwdbwd 8192x128256 bf16", "cross_entropy fwdbwd 8192x128256 fp16"} <= set(names)
    assert {f"fused_adam step {s} fp32" for s in _gpu_adam.GPU_SETS} <= set(names)
    for c in gpu:  # tensors well past L2: every case moves at least 256 MB
        assert c.bytes_min >= 256 * MB, c.name
        assert c.labels[0] == "apex" and len(c.labels) >= 3, c.name
    # --quick: one shape per operation, bf16 (fp32 for the optimizer), first in a budget-limited run
    quick = [c for c in gpu if c.quick]
    assert {c.op for c in quick} == {c.op for c in gpu} and all(c.dtype != torch.float16 for c in quick)
    assert names[: len(quick)] == [c.name for c in quick]
    # The CPU-sized cases: other modules' Triton kernels only; the CPU-only ones (amp O1 steps) on request.
    small_names = [c.name for _, c in small]
    assert all(c.counted is not None for _, c in small) and not any(n.startswith("layer_norm") for n in small_names)
    _, with_cpu = run.cuda_plan(cpu_cases=True)
    assert len(with_cpu) > len(small) and any(c.counted is None for _, c in with_cpu)


def _case(name):
    return next(c for c in run.cuda_plan()[0] if c.name == name)


def test_minimum_bytes_formulas():
    m, n, b2 = 16384, 4096, 2  # bf16
    ln = _case("layer_norm fwd 16384x4096 bf16")
    assert ln.bytes_min == m * n * b2 + 2 * n * b2 + m * n * b2 + 2 * 4 * m  # read x, w, b; write y, mean, rstd
    assert _case("layer_norm bwd 16384x4096 bf16").bytes_min == (
        2 * m * n * b2 + n * b2 + 2 * 4 * m + m * n * b2 + 2 * n * b2)  # dy, x, w, mean, rstd; dx, dw, db
    assert _case("rms_norm fwd 16384x4096 fp16").bytes_min == 2 * m * n * 2 + n * 2 + 4 * m
    assert _case("rms_norm bwd 16384x4096 fp16").bytes_min == 3 * m * n * 2 + 2 * n * 2 + 4 * m
    e = 128 * 2048 * 2048 * 2
    assert _case("softmax_causal fwd 1x128x2048x2048 bf16").bytes_min == 2 * e
    assert _case("softmax_causal bwd 1x128x2048x2048 bf16").bytes_min == 3 * e
    t = 4096 * 4 * 32 * 128 * 2
    assert _case("rope_sbhd fwd 4096x4x32x128 bf16").bytes_min == 2 * t + 4096 * 128 * 4
    x = 16384 * 16384 * 2
    assert _case("bias_swiglu fwd 16384x16384 bf16").bytes_min == x + 16384 * 2 + x // 2
    assert _case("bias_swiglu bwd 16384x16384 bf16").bytes_min == x // 2 + 2 * x + 2 * 16384 * 2
    assert _case("cross_entropy fwdbwd 8192x128256 bf16").bytes_min == 2 * 8192 * 128256 * 2 + 8 * 8192
    assert _case("fused_adam step 24x4096^2 fp32").bytes_min == 28 * 24 * 4096 * 4096
    assert _case("fused_adam step 10000x10K fp32").bytes_min == 28 * 10_000 * 10_000


def _small_cases():
    bf16 = [torch.bfloat16]
    return (bench_layer_norm.gpu_cases([(8, 64)], bf16) + bench_rms_norm.gpu_cases([(8, 64)], bf16)
            + bench_scaled_masked_softmax.gpu_cases([(1, 2, 16, 16)], bf16)
            + bench_fused_rope.gpu_cases([(8, 2, 4, 16)], bf16) + bench_bias_swiglu.gpu_cases([(8, 64)], bf16)
            + bench_xentropy.gpu_cases([(8, 100)], bf16)
            + _gpu_adam.gpu_cases({"3x100": (3, 100), "mixed": (4, "mixed", 50)}))


def test_runner_times_rates_and_checks_every_implementation(triton_device):
    """The GPU code path on the Triton path (interpreted here, compiled under APEX_TEST_DEVICE=cuda) with a
    fake timer: a row per implementation with the rate of the minimum bytes and a small error."""
    timer = fake_timer(0.5)
    with apex.backend("triton"):
        for case in _small_cases():
            rows = _gpu.run_case(case, triton_device, timer, copy_gbps=100.0, compile_backend="eager")
            assert [r["impl"] for r in rows] == case.labels, case.name
            for r in rows:
                assert "error" not in r, r
                assert r["ms"] == 0.5 and r["gbps"] == pytest.approx(case.bytes_min / 0.5e-3 / 1e9)
                assert r["copy_pct"] == pytest.approx(r["gbps"])  # of 100 GB/s
                # bf16 outputs: about 2^-9 relative; fp32 Adam updates: the fp32 rounding of p
                assert r["rel_err"] < (1e-2 if case.dtype == torch.bfloat16 else 1e-4), r
    assert len(timer.calls) == sum(len(c.labels) for c in _small_cases())


def test_runner_reports_a_wrong_result_and_a_failure_without_stopping():
    (case, _) = bench_rms_norm.gpu_cases([(8, 64)], [torch.float16])
    case.impls = {"apex": case.impls["apex"], "wrong": _gpu.fn_impl(lambda i: i["x"] * 1.01, ("x", "w")),
                  "nan": _gpu.fn_impl(lambda i: i["x"] * float("nan"), ("x", "w")),
                  "broken": _gpu.fn_impl(lambda i: i["missing"], ("x", "w")), "torch": case.impls["torch"]}
    case.compiled = None
    rows = {r["impl"]: r for r in _gpu.run_case(case, torch.device("cpu"), fake_timer(), 100.0)}
    assert rows["apex"]["rel_err"] < 1e-3 and rows["wrong"]["rel_err"] > 1e-2
    assert rows["nan"]["rel_err"] != rows["nan"]["rel_err"]  # NaN is reported, not hidden by max()
    assert rows["broken"]["error"].startswith("KeyError") and "ms" in rows["torch"]


def test_rate_rows_compares_apex_with_the_fastest_other():
    rows = [{"case": "c", "impl": "apex", "ms": 2.0}, {"case": "c", "impl": "torch", "ms": 4.0},
            {"case": "c", "impl": "liger", "ms": 1.0}, {"case": "c", "impl": "torch.compile", "error": "x"}]
    _gpu.rate_rows(rows)
    assert rows[0]["vs_best"] == 2.0


def test_liger_rows_appear_where_it_is_installed(monkeypatch):
    monkeypatch.setattr(_gpu, "liger_available", lambda: True)
    for module in (bench_layer_norm, bench_rms_norm, bench_fused_rope, bench_xentropy):
        assert all("liger" in c.labels for c in module.gpu_cases())
    monkeypatch.setattr(_gpu, "liger_available", lambda: False)
    assert not any("liger" in c.labels for c in run.cuda_plan()[0])


def test_run_cuda_prints_rows_writes_the_report_and_caps_cases(tmp_path, monkeypatch, capsys):
    cases = bench_layer_norm.gpu_cases([(8, 64)], [torch.bfloat16])
    slow = bench_rms_norm.gpu_cases([(8, 64)], [torch.bfloat16])[0]
    slow.impls["apex"] = _gpu.fn_impl(lambda i: time.sleep(30), ("x", "w"))
    monkeypatch.setattr(run, "cuda_plan", lambda *a: (cases[:1] + [slow] + cases[1:], []))
    rc = run.run_cuda(_args(tmp_path, case_cap=2.0), device=torch.device("cpu"), timer=fake_timer())
    out = capsys.readouterr().out
    assert rc == 1  # the capped case is an error row
    assert "| layer_norm fwd 8x64 bf16 | apex | 0.5000 |" in out and "| layer_norm bwd 8x64 bf16 | torch" in out
    assert "| rms_norm fwd 8x64 bf16 | apex, torch, torch.compile | - |" in out and "CaseTimeout" in out
    report = (tmp_path / "gpu.md").read_text()
    assert "apex GB/s" in report and "torch.compile GB/s" in report and "layer_norm bwd 8x64 bf16" in report
    assert (tmp_path / "gpu.png").exists() or importlib.util.find_spec("matplotlib") is None
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["copy_gbps"] > 0 and {r["impl"] for r in data["rows"]} >= {"apex", "torch", "torch.compile"}


def test_time_cap_lets_an_import_finish(tmp_path, monkeypatch):
    # A cap that fires inside an import stops the case after it: a module interrupted half-way would stay
    # half-initialised (sympy, imported by the first autograd call, broke every later backward case so).
    (tmp_path / "apex_slow_import_probe.py").write_text("import time\ntime.sleep(0.6)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(_gpu.CaseTimeout), _gpu.time_cap(0.2):
        import apex_slow_import_probe  # noqa: F401
        time.sleep(20)
    assert 0.6 <= time.monotonic() - t0 < 5
    import sys

    assert sys.modules.pop("apex_slow_import_probe").DONE


def test_kernels_profile_what_a_call_runs(tmp_path, monkeypatch, capsys):
    # --kernels: each row also says what one call runs (here the CPU operators stand in for the kernels): the
    # eager RMSNorm backward's operators, one call's worth, and the (all) total; printed, in the report and JSON.
    cases = bench_rms_norm.gpu_cases([(8, 64)], [torch.float32])
    monkeypatch.setattr(run, "cuda_plan", lambda *a: (cases, []))
    assert run.run_cuda(_args(tmp_path, kernels=True, no_compile=True), device=torch.device("cpu"),
                        timer=fake_timer()) == 0
    out = capsys.readouterr().out
    assert "#   torch kernels per call: " in out and "(all)" in out
    rows = {(r["mode"], r["impl"]): r for r in json.loads((tmp_path / "gpu.json").read_text())["rows"]}
    ks = rows[("bwd", "torch")]["kernels"]
    assert ks[-1]["name"] == "(all)" and ks[-1]["us"] >= max(k["us"] for k in ks[:-1]) > 0
    assert all(k["name"].startswith("aten::") and k["per_call"] > 0 for k in ks[:-1])
    assert "## Kernels per call" in (tmp_path / "gpu.md").read_text()
    assert all("kernels" not in r for r in _gpu.run_case(cases[0], torch.device("cpu"), fake_timer(), 1.0,
                                                          compile_backend=None))


def test_run_cuda_stops_starting_cases_after_its_budget(tmp_path, monkeypatch, capsys):
    cases = bench_layer_norm.gpu_cases([(8, 64)], [torch.bfloat16])
    monkeypatch.setattr(run, "cuda_plan", lambda *a: (cases, []))
    assert run.run_cuda(_args(tmp_path, budget=0.0), device=torch.device("cpu"), timer=fake_timer()) == 0
    assert "Not reached within the 0 s budget: layer_norm fwd 8x64 bf16; layer_norm bwd 8x64 bf16" in \
        capsys.readouterr().out


def test_time_cap_interrupts_a_long_block():
    t0 = time.monotonic()
    with pytest.raises(_gpu.CaseTimeout), _gpu.time_cap(0.5):
        time.sleep(20)
    assert time.monotonic() - t0 < 5
    with _gpu.time_cap(5):  # a block within its cap is left alone, and the timer is disarmed after it
        pass
    time.sleep(0.01)
