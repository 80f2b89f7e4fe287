"""APEX_AMP_CPU_HALF: the process-wide switch that makes O1-O3 use fp16 on the CPU, as Apex does on CUDA,
instead of the CPU default bf16; explicit arguments still win; a bad value is an error naming the variable.
Also Apex's O1 rule that ``Tensor.cpu()`` of a half tensor returns fp32."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from apex import amp
from apex.amp import _amp_state
from tests.amp._models import mlp


def _init(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the slow-half warning of this CPU is not under test here
        return amp.initialize(*args, verbosity=0, **kwargs)


@pytest.mark.parametrize("value,dtype", [(None, torch.bfloat16), ("bf16", torch.bfloat16),
                                         ("fp16", torch.float16), (" Float16 ", torch.float16),
                                         ("half", torch.float16)])
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_switch_picks_the_cpu_half_type_of_every_level(monkeypatch, value, dtype, opt_level):
    if value is None:
        monkeypatch.delenv("APEX_AMP_CPU_HALF", raising=False)
    else:
        monkeypatch.setenv("APEX_AMP_CPU_HALF", value)
    model = nn.Linear(8, 8)
    model, opt = _init(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level)
    x = torch.randn(4, 8)
    try:
        assert _amp_state.half_dtype == dtype
        if opt_level == "O1":
            assert model(x).dtype == dtype
        else:  # the model runs in the half type (its output is cast back to fp32, as in Apex)
            assert model.weight.dtype == dtype
    finally:
        amp.init(enabled=False)


def test_legacy_amp_init_follows_the_switch(monkeypatch):
    monkeypatch.setenv("APEX_AMP_CPU_HALF", "fp16")
    handle = amp.init(enabled=True)
    try:
        w = torch.randn(8, 8)
        assert F.linear(torch.randn(2, 8), w).dtype == torch.float16
        assert torch.randn(2, 8).half().sum().dtype == torch.float32  # Apex's fp32 list, with fp16 inputs
    finally:
        handle._deactivate()


def test_explicit_dtypes_win_over_the_switch(monkeypatch):
    monkeypatch.setenv("APEX_AMP_CPU_HALF", "fp16")
    model = nn.Linear(8, 8)
    model = _init(model, opt_level="O2", half_dtype=torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16
    model = _init(nn.Linear(8, 8), opt_level="O3", cast_model_type=torch.bfloat16)
    assert model.weight.dtype == torch.bfloat16
    handle = amp.init(enabled=True, patch_type=torch.bfloat16)
    try:
        assert F.linear(torch.randn(2, 8), torch.randn(8, 8)).dtype == torch.bfloat16
    finally:
        handle._deactivate()


def test_bad_value_raises_naming_the_variable_and_leaves_amp_off(monkeypatch):
    monkeypatch.setenv("APEX_AMP_CPU_HALF", "fp8")
    model = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="APEX_AMP_CPU_HALF.*'fp8'"):
        _init(model, opt_level="O2")
    assert model.weight.dtype == torch.float32
    assert not hasattr(_amp_state, "opt_properties")
    with pytest.raises(ValueError, match="APEX_AMP_CPU_HALF"):
        amp.init(enabled=True)
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_fp16_overflow_halves_the_scale_and_skips_the_step(monkeypatch, opt_level):
    """With fp16, activations of x * 2**17 overflow (they do not in bf16): the dynamic scale halves per
    overflowing loss and the step is skipped, as on CUDA."""
    monkeypatch.setenv("APEX_AMP_CPU_HALF", "fp16")
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = _init(model, opt, opt_level=opt_level, num_losses=2)
    before = [p.detach().clone() for p in amp.master_params(opt)]
    scales = [s.loss_scale() for s in _amp_state.loss_scalers]
    x = torch.randn(16, 16) * 2.0**17
    for loss_id in (0, 1):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().mean(), opt, loss_id=loss_id) as scaled:
            scaled.backward()
        opt.step()
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [scales[0] / 2, scales[1] / 2]
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(opt), before))
    amp.init(enabled=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_o1_tensor_cpu_returns_fp32(dtype):
    x = torch.randn(4, 4, dtype=dtype)
    handle = amp.init(enabled=True, patch_type=dtype)
    try:
        assert x.cpu().dtype == torch.float32
        assert torch.equal(x.cpu(), x.float())
        assert torch.randn(3).cpu().dtype == torch.float32
    finally:
        handle._deactivate()
    assert x.cpu() is x  # restored: a no-op on a CPU tensor again
