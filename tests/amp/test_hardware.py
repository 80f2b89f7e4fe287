"""apex._hardware (which dtypes a device computes at full speed) and amp's warning that follows it.

The CPU queries are replaced both ways, so these tests mean the same on a CPU with and without bf16
hardware.
"""

import subprocess
import sys
import warnings

import pytest
import torch

from apex import _hardware, amp
from apex.amp import _amp_state
from apex.amp._slow_half import SlowHalfWarning

NO_HALF = {"avx512_bf16": False, "amx_tile": False, "amx_fp16": False, "mkldnn_bf16": False, "mkldnn_fp16": False}


@pytest.fixture
def cpu_features(monkeypatch):
    """Set the CPU features PyTorch reports: ``cpu_features(avx512_bf16=True)``."""

    def set_features(**feats):
        monkeypatch.setattr(_hardware, "_cpu_features", lambda: {**NO_HALF, **feats})
        monkeypatch.setattr(_hardware.platform, "machine", lambda: "x86_64")
        _hardware.cache_clear()
        monkeypatch.setattr(_amp_state, "slow_half_warned", set(), raising=False)

    yield set_features
    _hardware.cache_clear()


def test_cpu_without_bf16_hardware_is_fp32_only(cpu_features):
    cpu_features()
    assert _hardware.fast_dtypes("cpu") == (torch.float32,)
    assert not _hardware.has_fast_half("cpu", torch.bfloat16)
    assert not _hardware.has_fast_half(torch.device("cpu"), torch.float16)
    assert _hardware.best_half("cpu") is None
    assert "no AVX512-BF16/AMX" in _hardware.capability("cpu").reason


@pytest.mark.parametrize("feature,reason", [("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX")])
def test_cpu_with_bf16_hardware(cpu_features, feature, reason):
    cpu_features(**{feature: True})
    assert _hardware.fast_dtypes(torch.zeros(1)) == (torch.float32, torch.bfloat16)
    assert _hardware.has_fast_half("cpu", torch.bfloat16) and not _hardware.has_fast_half("cpu", torch.float16)
    assert _hardware.best_half("cpu") is torch.bfloat16
    assert _hardware.capability("cpu").reason.startswith(reason + ", no AMX-FP16")


def test_mkldnn_bf16_alone_is_not_bf16_hardware_on_x86(cpu_features):
    # PyTorch's mkldnn query says yes for AVX512 without the BF16 extension, where bf16 is emulated.
    cpu_features(mkldnn_bf16=True)
    assert not _hardware.has_fast_half("cpu", torch.bfloat16)


@pytest.mark.parametrize("cc,fast", [((6, 1), (torch.float32,)), ((7, 5), (torch.float32, torch.float16)),
                                     ((9, 0), (torch.float32, torch.bfloat16, torch.float16))])
def test_cuda_follows_compute_capability(monkeypatch, cc, fast):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "pretend GPU")
    monkeypatch.setattr(torch.version, "hip", None)
    _hardware.cache_clear()
    try:
        cap = _hardware.capability("cuda:0")
        assert cap.fast == fast and cap.reason == f"compute capability {cc[0]}.{cc[1]}"
    finally:
        _hardware.cache_clear()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="dtype"):
        _hardware.has_fast_half("cpu", torch.float32)
    with pytest.raises(ValueError, match="device"):
        _hardware.capability(3.5)
    with pytest.raises(ValueError, match="dtype"):
        _hardware.measure_slowdown(torch.float64)


def test_measured_slowdown_is_a_real_timing():
    s = _hardware.measure_slowdown(torch.bfloat16, "cpu", 64, 2)
    assert s.half_ms > 0 and s.fp32_ms > 0 and s.factor == pytest.approx(s.half_ms / s.fp32_ms)
    assert "64x64 bf16 matmul measured" in s.describe()
    assert torch.get_num_threads() == 1  # restored (tests/amp run on one thread)


def _init(opt_level="O1", **kw):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level=opt_level, verbosity=0, **kw)


def test_amp_warns_once_with_a_measured_factor_without_bf16_hardware(cpu_features):
    cpu_features()
    with pytest.warns(SlowHalfWarning) as record:
        model, opt = _init("O1")
    msg = str(record[0].message)
    assert "bf16" in msg and "no AVX512-BF16/AMX" in msg and 'opt_level="O0"' in msg
    assert "matmul measured" in msg and "x the time of fp32" in msg
    # Apex semantics: it still does what was asked.
    assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _init("O2")  # once per process
    assert _amp_state.half_dtype is torch.bfloat16


def test_amp_does_not_warn_with_bf16_hardware_or_in_fp32(cpu_features):
    cpu_features(avx512_bf16=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _init("O1")
        _init("O2")
    cpu_features()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _init("O0")  # fp32: nothing to warn about
    assert _amp_state.half_dtype is torch.bfloat16  # the CPU default stays bf16


def test_amp_warns_for_fp16_on_a_cpu_with_bf16_only(cpu_features):
    cpu_features(avx512_bf16=True)
    with pytest.warns(SlowHalfWarning, match="fp16"):
        _init("O2", half_dtype=torch.float16)


def test_python_dash_m_apex_prints_the_fast_dtypes():
    out = subprocess.run([sys.executable, "-m", "apex"], capture_output=True, text=True, timeout=120, check=True)
    line = next(s for s in out.stdout.splitlines() if s.startswith("fast dtypes on cpu:"))
    assert "float32" in line
    assert ("bfloat16" in line) == _hardware.has_fast_half("cpu", torch.bfloat16)
