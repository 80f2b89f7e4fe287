"""Distributed tests on a GPU (the ``dist_device`` fixture, ``run_distributed(device=...)``) and the capped
autotuning of the device switch, checked without a GPU: the arguments, which tests opt in, and that under
``APEX_TEST_DEVICE=cuda`` without CUDA they are skipped with the reason rather than run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from apex.testing import run_distributed
from apex.testing.distributed import _rank_device
from tests import _device

ROOT = Path(__file__).resolve().parents[1]
# The distributed tests whose ranks run on the GPU under the switch (all of them through dist_device).
CONVERTED = {
    "tests/parallel/test_sync_batchnorm_dist.py": 3, "tests/parallel/test_ddp.py": 2,
    "tests/contrib/test_distributed_fused_adam.py": 3, "tests/contrib/test_distributed_fused_lamb.py": 2,
    "tests/transformer/test_pipeline.py": 1,
}
TRANSFORMER = ("tests/transformer/test_layers.py", "tests/transformer/test_mappings.py",
               "tests/transformer/test_cross_entropy.py")


def _never_called(rank, world):
    raise AssertionError("no rank may start")


def test_run_distributed_device_argument():
    assert _rank_device(None) is None and _rank_device("cpu") is None and _rank_device(torch.device("cpu")) is None
    with pytest.raises(ValueError, match="CPU or CUDA device"):
        run_distributed(_never_called, 2, device="meta")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device is visible"):
            run_distributed(_never_called, 2, device="cuda")
    else:
        assert _rank_device("cuda") == torch.device("cuda", torch.cuda.current_device())


def test_dist_device_is_the_cpu_without_the_switch(dist_device, request):
    assert dist_device == torch.device("cpu") or _device.requested() == "cuda"
    assert request.node.get_closest_marker("dist_device") is not None  # taking the fixture marks the test


def _pytest(*args, device):
    env = {**os.environ, "APEX_TEST_DEVICE": device}
    env.pop("PYTEST_XDIST_WORKER", None)
    if device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU, even on a machine that has one
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return run.returncode, run.stdout + run.stderr


def test_the_marker_selects_exactly_the_converted_tests():
    rc, out = _pytest(*CONVERTED, *TRANSFORMER, "-m", "dist_device", "--collect-only", device="cpu")
    assert rc == 0, out
    ids = [ln for ln in out.splitlines() if "::" in ln]
    for path, n in CONVERTED.items():
        assert sum(i.startswith(path) for i in ids) == n, (path, ids)
    for path in TRANSFORMER:
        assert any(i.startswith(path + "::test_distributed[") for i in ids), path
    assert not any("test_three_ranks_match_fused_lamb" in i or "test_ddp_bad_input" in i for i in ids)


def test_under_the_cuda_switch_without_cuda_they_skip_with_the_reason():
    rc, out = _pytest("tests/parallel/test_sync_batchnorm_dist.py", "tests/transformer/test_mappings.py",
                      "-m", "dist_device", "-rs", device="cuda")
    assert rc == 0, out
    assert "passed" not in out.splitlines()[-1] and " skipped" in out.splitlines()[-1], out
    assert "APEX_TEST_DEVICE=cuda, but no CUDA device is visible" in out


def test_cap_autotuning(monkeypatch):
    from apex.contrib.openfold_triton import _tuning

    kernels = {"a": SimpleNamespace(configs=list(range(24))), "b": SimpleNamespace(configs=[7])}
    monkeypatch.setattr(_tuning.KERNELS, "get", lambda: kernels)
    monkeypatch.delenv("APEX_TEST_AUTOTUNE_CONFIGS", raising=False)
    _device.cap_autotuning()
    assert kernels["a"].configs == [0, 23] and kernels["b"].configs == [7]  # the ends of the list
    kernels["a"].configs = list(range(24))
    monkeypatch.setenv("APEX_TEST_AUTOTUNE_CONFIGS", "3")
    _device.cap_autotuning()
    assert kernels["a"].configs == [0, 12, 23]
    kernels["a"].configs = list(range(24))
    monkeypatch.setenv("APEX_TEST_AUTOTUNE_CONFIGS", "0")
    _device.cap_autotuning()
    assert kernels["a"].configs == list(range(24))
    monkeypatch.setenv("APEX_TEST_AUTOTUNE_CONFIGS", "few")
    with pytest.raises(pytest.UsageError, match="APEX_TEST_AUTOTUNE_CONFIGS"):
        _device.cap_autotuning()


def test_the_autotuned_kernels_are_capped_under_the_cuda_switch():
    """What conftest does under APEX_TEST_DEVICE=cuda, without a GPU: the real OpenFold kernels go from
    their 24 GPU configs to 2 (the interpreter's single config is not a GPU's list)."""
    code = ("import os; os.environ['TRITON_INTERPRET'] = '0'\n"
            "from apex.contrib.openfold_triton._tuning import KERNELS\n"
            "before = {k: len(f.configs) for k, f in KERNELS.get().items()}\n"
            "from tests import _device; _device.cap_autotuning()\n"
            "print(before, {k: len(f.configs) for k, f in KERNELS.get().items()})")
    env = {k: v for k, v in os.environ.items() if k != "APEX_TEST_AUTOTUNE_CONFIGS"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "{'_ln_fwd': 24, '_ln_bwd': 24} {'_ln_fwd': 2, '_ln_bwd': 2}", out.stderr
