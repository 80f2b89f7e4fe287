"""update_scale_hysteresis against a plain-Python transcription of the CUDA kernel."""

import math

import amp_C
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex.ops.update_scale_hysteresis import _update_torch, update_scale_hysteresis
from tests.conftest import HAS_TRITON


def _reference(scale, growth, hyst, found, growth_factor, backoff_factor, interval, hysteresis):
    """The kernel, line by line, on Python numbers (float32 rounding of the products via torch)."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float64).float().item()
    if found > 0:
        hyst -= 1
        if hyst > 0:
            return scale, 0, hyst
    if found:
        scale = f32(scale * backoff_factor)
        if abs(scale) < torch.finfo(torch.float32).tiny:  # Apex's kernel is built with fast math: FTZ
            scale = 0.0
        growth = 0
    else:
        successful = growth + 1
        if successful == interval:
            new = f32(scale * growth_factor)
            if math.isfinite(new):
                scale = new
            growth = 0
        else:
            growth = successful
    if found <= 0:
        hyst = hysteresis
    return scale, growth, hyst


def _state(scale=65536.0, growth=0, hyst=2):
    return (torch.tensor([scale], dtype=torch.float32), torch.tensor([growth], dtype=torch.int32),
            torch.tensor([hyst], dtype=torch.int32))


def _run_sequence(found_seq, growth_factor, backoff_factor, interval, hysteresis, start,
                  fn=update_scale_hysteresis):
    s, g, h = _state(*start)
    ref = (s.item(), g.item(), h.item())
    for f in found_seq:
        out = fn(s, g, h, torch.tensor([f], dtype=torch.float32), growth_factor, backoff_factor, interval,
                 hysteresis)
        assert out is s or out is None
        ref = _reference(*ref, f, growth_factor, backoff_factor, interval, hysteresis)
        assert (s.item(), g.item(), h.item()) == ref, (f, ref, (s.item(), g.item(), h.item()))


def test_hysteresis_absorbs_overflows_then_backs_off(backend_name):
    s, g, h = _state(1024.0, 3, 2)
    inf, ok = torch.ones(1), torch.zeros(1)
    update_scale_hysteresis(s, g, h, inf, 2.0, 0.5, 1000, 2)
    assert (s.item(), g.item(), h.item()) == (1024.0, 0, 1)  # absorbed
    update_scale_hysteresis(s, g, h, inf, 2.0, 0.5, 1000, 2)
    assert (s.item(), g.item(), h.item()) == (512.0, 0, 0)   # hysteresis exhausted: back off
    update_scale_hysteresis(s, g, h, inf, 2.0, 0.5, 1000, 2)
    assert (s.item(), g.item(), h.item()) == (256.0, 0, -1)
    update_scale_hysteresis(s, g, h, ok, 2.0, 0.5, 1000, 2)
    assert (s.item(), g.item(), h.item()) == (256.0, 1, 2)   # a clean step resets hysteresis


def test_growth_after_interval_and_never_to_inf(backend_name):
    s, g, h = _state(2.0 ** 90, 0, 1)
    for _ in range(3):
        update_scale_hysteresis(s, g, h, torch.zeros(1), 2.0 ** 30, 0.5, 3, 1)
    assert s.item() == 2.0 ** 120 and g.item() == 0
    for _ in range(3):
        update_scale_hysteresis(s, g, h, torch.zeros(1), 2.0 ** 30, 0.5, 3, 1)
    assert s.item() == 2.0 ** 120, "growth past fp32 max must be refused"
    assert g.item() == 0


@settings(max_examples=25, deadline=None)
@given(found=st.lists(st.sampled_from([0.0, 1.0, 3.0]), min_size=1, max_size=12),
       growth_factor=st.sampled_from([2.0, 1.5, 3.0]), backoff_factor=st.sampled_from([0.5, 0.3, 0.75]),
       interval=st.integers(1, 4), hysteresis=st.integers(1, 3),
       scale=st.sampled_from([1.0, 65536.0, 3.3e38, 1e-3]), growth=st.integers(0, 3),
       hyst=st.integers(-1, 3))
def test_matches_kernel_reference_torch(found, growth_factor, backoff_factor, interval, hysteresis, scale,
                                        growth, hyst):
    import apex

    with apex.backend("torch"):
        _run_sequence(found, growth_factor, backoff_factor, interval, hysteresis, (scale, growth, hyst))
    # The sync-free formulation used for GPU tensors when Triton is not in use.
    _run_sequence(found, growth_factor, backoff_factor, interval, hysteresis, (scale, growth, hyst),
                  fn=_update_torch)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(found=st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=6),
       backoff_factor=st.sampled_from([0.5, 0.3]), interval=st.integers(1, 3), hysteresis=st.integers(1, 3))
def test_matches_kernel_reference_triton(triton_device, found, backoff_factor, interval, hysteresis):
    import apex
    from apex.testing import TritonTrace

    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        _run_sequence(found, 2.0, backoff_factor, interval, hysteresis, (3.0e38, 0, 2))
    assert tr.launches == len(found)


def test_exported_through_amp_c():
    assert amp_C.update_scale_hysteresis is update_scale_hysteresis


def test_device_path_has_no_host_sync():
    from apex.testing import count_eager

    s, g, h = _state()
    found = torch.ones(1)
    c = count_eager(lambda: _update_torch(s, g, h, found, 2.0, 0.5, 10, 2))
    assert c["syncs"] == 0


@pytest.mark.parametrize("bad,exc", [
    (dict(current_scale=torch.ones(1, dtype=torch.float64)), ValueError),
    (dict(growth_tracker=torch.zeros(1, dtype=torch.int64)), ValueError),
    (dict(hysteresis_tracker=3), TypeError),
    (dict(found_inf=torch.zeros(2)), ValueError),
    (dict(growth_interval=2.0), TypeError),
])
def test_bad_input_raises_and_changes_nothing(bad, exc):
    s, g, h = _state(8.0, 1, 2)
    args = dict(current_scale=s, growth_tracker=g, hysteresis_tracker=h, found_inf=torch.ones(1),
                growth_factor=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=2)
    args.update(bad)
    with pytest.raises(exc):
        update_scale_hysteresis(**args)
    assert (s.item(), g.item(), h.item()) == (8.0, 1, 2)


def test_backoff_into_subnormals_flushes_to_zero(backend_name):
    # Apex's upstream test: a scale backed off below the smallest normal fp32 becomes 0, and stays 0.
    s, g, h = _state(scale=2.0 ** -120, hyst=1)
    found = torch.tensor([1.0])
    for _ in range(5):
        update_scale_hysteresis(s, g, h, found, 2.0, 0.25, 10, 1)
        assert s.item() == 0.0 or s.item() >= torch.finfo(torch.float32).tiny
    assert s.item() == 0.0
    found.zero_()
    for _ in range(20):
        update_scale_hysteresis(s, g, h, found, 2.0, 0.25, 10, 1)
    assert s.item() == 0.0
