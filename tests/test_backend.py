import subprocess
import sys

import pytest
import torch

import apex
from apex import _backend


def test_default_on_cpu_is_torch(monkeypatch):
    monkeypatch.delenv("APEX_BACKEND", raising=False)
    assert _backend.current_backend() == "auto"
    assert _backend.select(torch.ones(1)) == "torch"
    assert _backend.select([[torch.ones(1)]]) == "torch"


def test_context_manager_overrides_env(monkeypatch):
    monkeypatch.setenv("APEX_BACKEND", "torch")
    assert _backend.select(torch.ones(1)) == "torch"
    with apex.backend("triton"):
        assert _backend.current_backend() == "triton"
        with apex.backend("auto"):
            assert _backend.current_backend() == "auto"
        assert _backend.current_backend() == "triton"
    assert _backend.current_backend() == "torch"


def test_env_var_is_read_at_call_time(monkeypatch):
    monkeypatch.setenv("APEX_BACKEND", "TORCH")
    assert _backend.current_backend() == "torch"
    monkeypatch.setenv("APEX_BACKEND", "auto")
    assert _backend.current_backend() == "auto"


def test_bad_names_are_rejected(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        with apex.backend("cuda"):
            pass
    monkeypatch.setenv("APEX_BACKEND", "fast")
    with pytest.raises(ValueError, match="APEX_BACKEND"):
        _backend.current_backend()


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    if not _backend.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with apex.backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _backend.select(torch.ones(1))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with apex.backend("triton"):
        assert _backend.select(torch.ones(1)) == "triton"


def test_triton_requested_without_triton(monkeypatch):
    monkeypatch.setattr(_backend, "triton_available", lambda: False)
    with apex.backend("triton"), pytest.raises(RuntimeError, match="not installed"):
        _backend.select(torch.ones(1))


def test_python_dash_m_apex_prints_environment():
    out = subprocess.run([sys.executable, "-m", "apex"], capture_output=True, text=True, check=True).stdout
    for word in ("apex:", "torch:", "triton:", "python:", "backend on cpu: torch", "interpreter:"):
        assert word in out
