"""The test suite's device switch (tests/_device.py, ``APEX_TEST_DEVICE``), checked without a GPU."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import apex
from tests import _device

ROOT = Path(__file__).resolve().parents[1]


def test_on_device_moves_what_a_test_creates_and_keeps_values():
    meta = torch.device("meta")  # stands in for a GPU: tensors move, nothing is computed
    g = torch.Generator().manual_seed(3)
    with _device.OnDevice(meta):
        a = torch.randn(5, generator=g)
        b = torch.zeros(2, 3, dtype=torch.float16, requires_grad=True)
        c = torch.ones(4, device="cpu")
        lin = torch.nn.Linear(3, 2)
        d = torch.full_like(c, 7.0)
    assert a.device == meta and b.device == meta and lin.weight.device == meta
    assert b.is_leaf and b.requires_grad and b.dtype == torch.float16
    assert c.device.type == "cpu" and d.device.type == "cpu"  # an explicit device and *_like are left alone
    with _device.OnDevice(torch.device("cpu")):
        again = torch.randn(5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(again, torch.randn(5, generator=torch.Generator().manual_seed(3)))


def test_launch_counter_counts_launches_not_autotuning(monkeypatch):
    from triton.runtime import autotuner, jit

    calls = []
    monkeypatch.setattr(jit.JITFunction, "run", lambda fn, *a, warmup=False, **kw: calls.append(warmup))
    monkeypatch.setattr(autotuner.Autotuner, "run", lambda tuner, *a, **kw: [tuner.fn.run(grid=(1,), warmup=False)
                                                                             for _ in range(3)])

    def my_kernel(x):
        pass

    kernel = jit.JITFunction(my_kernel)
    tuner = autotuner.Autotuner.__new__(autotuner.Autotuner)
    tuner.fn = kernel
    patched = (jit.JITFunction.run, autotuner.Autotuner.run)
    with _device.LaunchCounter(bounds=True) as tr:
        tr.watch(torch.zeros(1))
        kernel[(4,)](1)
        kernel[(4,)](2)
        kernel.warmup(1, grid=(1,))  # compiles, launches nothing
        tuner.run(1)  # three benchmarking runs, one launch
    assert tr.launches == 3 and tr.kernels == {"my_kernel": 3} and len(calls) == 6
    assert (jit.JITFunction.run, autotuner.Autotuner.run) == patched  # restored on exit
    with pytest.raises(pytest.skip.Exception, match="interpreter"):
        _ = tr.bytes_unique


def test_triton_device_follows_the_switch(monkeypatch):
    monkeypatch.setenv("APEX_TEST_DEVICE", "cpu")
    assert _device.triton_device() == (torch.device("cpu"), "")
    monkeypatch.setenv("APEX_TEST_DEVICE", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    where, why = _device.triton_device()
    assert where is None and "no CUDA device" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert _device.triton_device() == (torch.device("cuda", 1), "")
    monkeypatch.setenv("APEX_TEST_DEVICE", "tpu")
    with pytest.raises(pytest.UsageError, match="APEX_TEST_DEVICE"):
        _device.requested()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without a GPU")
def test_switch_skips_triton_cases_with_a_reason_without_gpu():
    env = dict(os.environ, APEX_TEST_DEVICE="cuda", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-rs",
                           "tests/ops/test_multi_tensor_scale.py", "-k", "mixed_dtypes_in_place"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed, 1 skipped" in proc.stdout
    assert "APEX_TEST_DEVICE=cuda, but no CUDA device is visible" in proc.stdout


def test_benchmark_gpu_rows_are_rates_of_the_minimum_bytes(monkeypatch, triton_device):
    """benchmarks/run.py --device cuda, with the CUDA-event timers replaced: the case runs where the
    Triton-path tests do (interpreted on the CPU, or compiled on the GPU under APEX_TEST_DEVICE=cuda)."""
    import apex.testing.device as dev
    from benchmarks.ops.bench_multi_tensor_scale import cases
    from benchmarks.run import format_gpu_table, gpu_case

    monkeypatch.setattr(dev, "cuda_time_pair", lambda a, b: (a(), b(), 0.5, 2.0)[2:])
    monkeypatch.setattr(dev, "cuda_time", lambda fn: (fn(), 0.25)[1])
    (case,) = cases()
    with apex.backend("triton"):  # (the interpreter on the CPU: the fixture selects no backend)
        row = gpu_case(case, triton_device, peak_gbps=100.0)
    assert "error" not in row, row
    assert row["ratio"] == 0.25 and row["counted_bytes"] > 0
    assert row["gbps"] == pytest.approx(row["counted_bytes"] / 0.25e-3 / 1e9)
    assert row["peak"] == pytest.approx(row["gbps"] / 100.0) and row["eager_gbps"] == row["gbps"]
    assert "multi_tensor_scale 1000 fp32" in format_gpu_table([row])


def test_peak_bandwidth_table():
    from apex.testing.device import peak_bandwidth

    assert peak_bandwidth("NVIDIA H100 80GB HBM3") == 3350
    assert peak_bandwidth("NVIDIA H100 PCIe") == 2000 and peak_bandwidth("NVIDIA H200") == 4800
    assert peak_bandwidth("NVIDIA A100-SXM4-40GB") == 1555 and peak_bandwidth("Some GPU") is None


def test_benchmark_cuda_refuses_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--device", "cuda", "-k", "scale"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_on_device_leaves_the_ops_own_host_tensors_alone():
    from apex.testing import device as dev

    assert dev._called_from_library(os.path.join(dev._APEX, "ops", "rms_norm.py"))
    assert dev._called_from_library(os.path.join(dev._APEX, "_kernels", "multi_tensor.py"))
    assert not dev._called_from_library(os.path.join(dev._APEX, "normalization", "fused_layer_norm.py"))
    assert not dev._called_from_library(__file__) and not dev._called_from_library(torch.nn.modules.linear.__file__)


_PLANTED = '''
import pytest
import torch
import triton
import triton.language as tl

import apex
from apex.ops import bias_gelu as G


@triton.jit
def _zero(X):
    tl.store(X, 0.0)


def test_outside_the_switch():
    with apex.backend("triton"):
        G.bias_gelu(torch.randn(4, 8), torch.randn(8))


def test_cpu_tensor_at_a_launch(triton_device):
    _zero[(1,)](torch.ones(1))  # made inside the switch: checked, not run
    _zero[(1,)](torch.ones(1, device="cpu"))


def test_cpu_tensor_in_an_argument_check(backend_name):
    G.bias_gelu(torch.randn(4, 8), torch.randn(8, device="cpu"))


def test_numpy_of_a_device_tensor(backend_name):
    torch.randn(3).numpy()


def test_ready_for_a_gpu(backend_name):
    x, b = torch.randn(4, 8), torch.randn(8)
    assert torch.allclose(G.bias_gelu(x, b), torch.nn.functional.gelu(x + b, approximate="tanh"), atol=1e-6)
'''


def test_meta_mode_fails_what_a_gpu_run_would_fail(tmp_path):
    """APEX_TEST_DEVICE=meta (tests/_device.py, MetaCheck) on planted tests: each way of leaving tensors on
    the CPU in a Triton-path case fails, the PyTorch-path cases pass, a ready test skips after its launch."""
    pytest.importorskip("triton")
    if _device.requested() == "cuda":
        pytest.skip("the meta mode is the CPU machines' stand-in for this GPU run")
    (tmp_path / "test_planted.py").write_text(_PLANTED)
    env = dict(os.environ, APEX_TEST_DEVICE="meta", PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "-p", "tests.conftest", "-v", "-rs", "--tb=line", str(tmp_path / "test_planted.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert "meta tensors, every Triton launch checked" in out, out + proc.stderr
    outcomes = dict(re.findall(r"::(\S+) (PASSED|FAILED|SKIPPED)", out))
    assert outcomes == {
        "test_outside_the_switch": "FAILED",
        "test_cpu_tensor_at_a_launch": "FAILED",
        "test_cpu_tensor_in_an_argument_check[torch]": "PASSED",
        "test_cpu_tensor_in_an_argument_check[triton]": "FAILED",
        "test_numpy_of_a_device_tensor[torch]": "PASSED",
        "test_numpy_of_a_device_tensor[triton]": "FAILED",
        "test_ready_for_a_gpu[torch]": "PASSED",
        "test_ready_for_a_gpu[triton]": "SKIPPED",
    }, out
    assert "_fwd_kernel launched outside the device switch" in out
    assert "_zero got tensors that are on the CPU under APEX_TEST_DEVICE=cuda: 0 (1,) torch.float32" in out
    assert "stopped after 1 checked Triton launches" in out


@pytest.mark.no_triton_launch("checks the test's own markers")
def test_kernel_tests_are_selected_by_the_gpu_checks_keyword(triton_device, request):
    """A test taking ``triton_device`` runs Triton kernels whatever its name (this one has no "triton" in it):
    the ``triton_path`` marker puts the word in its keywords, so the GPU check's ``-k triton`` selects it
    (158 tests were left out of every GPU run before)."""
    from _pytest.mark import KeywordMatcher
    from _pytest.mark.expression import Expression

    assert request.node.get_closest_marker("triton_path") is not None
    assert "triton" not in request.node.name
    assert Expression.compile("triton or cuda_graph").evaluate(KeywordMatcher.from_item(request.node))


_NO_LAUNCH = '''
import pytest
import torch

import apex
from apex.normalization import fused_rms_norm


def test_forgets_the_backend(triton_device):
    fused_rms_norm(torch.randn(4, 8), (8,))  # the fixture selects no backend: PyTorch's path


def test_selects_it(triton_device):
    with apex.backend("triton"):
        fused_rms_norm(torch.randn(4, 8), (8,))


@pytest.mark.no_triton_launch("a refusal before any launch")
def test_launches_none_by_design(triton_device):
    pass
'''


def test_a_triton_device_test_that_launches_nothing_fails(tmp_path):
    """On the CPU a test taking ``triton_device`` must launch a Triton kernel: one calling a public entry
    without ``apex.backend("triton")`` checks PyTorch's path only and fails, naming the fix; a marked one passes."""
    pytest.importorskip("triton")
    if _device.requested() != "cpu":
        pytest.skip("the interpreter's launches are counted (on a GPU the default backend is Triton's)")
    (tmp_path / "test_planted_launches.py").write_text(_NO_LAUNCH)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider",
                           "-p", "tests.conftest", "-v", "--tb=line", str(tmp_path / "test_planted_launches.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    outcomes = dict(re.findall(r"::(\S+) (PASSED|FAILED)", proc.stdout))
    assert outcomes == {"test_forgets_the_backend": "FAILED", "test_selects_it": "PASSED",
                        "test_launches_none_by_design": "PASSED"}, proc.stdout + proc.stderr
    assert "launched no Triton kernel: select the Triton path" in proc.stdout
