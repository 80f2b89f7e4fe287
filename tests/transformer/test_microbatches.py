"""Microbatch calculators (pure Python) and the global calculator in pipeline_parallel.utils."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.transformer import microbatches as mb
from apex.transformer.pipeline_parallel import utils


def test_constant():
    c = mb.build_num_microbatches_calculator(0, None, 24, 2, 3)
    assert isinstance(c, mb.ConstantNumMicroBatches)
    assert c.get() == 4 and c.get_current_global_batch_size() == 24 and c.micro_batch_size == 2
    c.update(10_000, True)
    assert c.get() == 4


@pytest.mark.parametrize("args", [(25, 2, 3), (0, 2, 1), (8, 0, 1), (8, 2, -1)])
def test_constant_bad_input(args):
    with pytest.raises(ValueError, match=r"global batch size \(25\)|must be > 0"):
        mb.ConstantNumMicroBatches(*args)


def test_errors_are_assertion_errors_too():
    with pytest.raises(AssertionError):  # upstream raised AssertionError: callers catching it keep working
        mb.ConstantNumMicroBatches(25, 2, 3)


def _ramp_expected(start, inc, samples, gbs, consumed):
    if consumed > samples:
        return gbs
    per_increment = samples / ((gbs - start) // inc)
    return start + int(consumed / per_increment) * inc


@settings(max_examples=30, deadline=None)
@given(start=st.integers(1, 8), steps=st.integers(1, 6), inc=st.integers(1, 5), samples=st.integers(1, 500),
       consumed=st.integers(0, 700))
def test_rampup_arithmetic(start, steps, inc, samples, consumed):
    gbs = start + steps * inc
    c = mb.build_num_microbatches_calculator(0, [start, inc, samples], gbs, 1, 1)
    assert isinstance(c, mb.RampupBatchsizeNumMicroBatches)
    assert c.get_current_global_batch_size() == start and c.get() == start
    c.update(consumed, True)
    want = _ramp_expected(start, inc, samples, gbs, consumed)
    assert c.get_current_global_batch_size() == want and c.get() == want


def test_rampup_concrete_and_consistency_check():
    # 16 -> 32 by 8 over 100 samples: 50 samples per increment.
    c = mb.RampupBatchsizeNumMicroBatches(16, 8, 100, 32, 4, 2)
    assert (c.get_current_global_batch_size(), c.get()) == (16, 2)
    c.update(49, True)
    assert c.get() == 2
    c.update(50, True)
    assert (c.get_current_global_batch_size(), c.get()) == (24, 3)
    c.update(101, True)
    assert (c.get_current_global_batch_size(), c.get()) == (32, 4)
    c2 = mb.RampupBatchsizeNumMicroBatches(4, 2, 10, 8, 4, 1)
    with pytest.raises(ValueError, match=r"current global batch size \(6\)"):
        c2.update(5, True)
    c2.update(5, False)
    assert c2.get() == 1  # floor without the check, as upstream


@pytest.mark.parametrize("ramp,gbs,match", [
    ([1, 2], 8, "rampup_batch_size"),
    ([16, 8, 100], 8, "must not exceed"),
    ([2, 4, 100], 8, r"interval \(6\).*increment \(4\)"),
    ([8, 2, 100], 8, "nothing to ramp up"),
    ([2, 2, -1], 8, "ramup_samples"),
])
def test_rampup_bad_input(ramp, gbs, match):
    with pytest.raises(ValueError, match=match):
        mb.build_num_microbatches_calculator(0, ramp, gbs, 1, 1)


@pytest.fixture
def fresh_global():
    saved = utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR
    utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None
    yield
    utils._GLOBAL_NUM_MICROBATCHES_CALCULATOR = saved


def test_global_calculator(fresh_global):
    with pytest.raises(RuntimeError, match="not initialized"):
        utils.get_num_microbatches()
    utils.setup_microbatch_calculator(0, [2, 2, 8], 6, 1, 2)
    assert utils.get_num_microbatches() == 1 and utils.get_micro_batch_size() == 1
    assert utils.get_current_global_batch_size() == 2
    utils.update_num_microbatches(9)
    assert utils.get_num_microbatches() == 3 and utils.get_current_global_batch_size() == 6
    with pytest.raises(RuntimeError, match="already initialized"):
        utils.setup_microbatch_calculator(0, None, 6, 1, 2)
    utils._reconfigure_microbatch_calculator(0, None, 12, 3, 1)
    assert utils.get_num_microbatches() == 4 and utils.get_micro_batch_size() == 3


def test_get_kth_microbatch(fresh_global):
    utils.setup_microbatch_calculator(0, None, 6, 2, 1)
    x, y = torch.randn(6, 3), torch.randn(6)
    for k in range(3):
        got = utils.get_kth_microbatch([x, y], k)
        assert torch.equal(got[0], x[2 * k:2 * k + 2]) and torch.equal(got[1], y[2 * k:2 * k + 2])
    assert utils.get_kth_microbatch(None, 0) is None
    with pytest.raises(ValueError, match=r"rows \[6, 8\)"):
        utils.get_kth_microbatch([x], 3)
    parts = list(utils._split_batch_into_microbatch([x]))
    assert len(parts) == 3 and torch.equal(torch.cat([p[0] for p in parts]), x)


def test_model_helpers():
    from apex.transformer.enums import ModelType

    m = torch.nn.Linear(2, 2)
    assert utils.listify_model(m) == [m] and utils.listify_model([m]) == [m]
    assert utils.unwrap_model(m) is m and utils.unwrap_model([m]) == [m]
    assert utils.get_model_type(m) == ModelType.encoder_or_decoder
    m.model_type = ModelType.encoder_and_decoder
    assert utils.get_model_type(m) == ModelType.encoder_and_decoder
    assert utils.param_is_not_shared(m.weight)
    m.weight.shared = True
    assert not utils.param_is_not_shared(m.weight)
    norm = utils.calc_params_l2_norm(m, bf16=False)  # the shared weight is skipped
    assert abs(norm - float(m.bias.detach().double().norm())) <= 1e-6 * norm



def test_print_params_min_max_norm(capsys):
    from apex.transformer.tensor_parallel import set_tensor_model_parallel_attributes

    m = torch.nn.Linear(3, 2)
    set_tensor_model_parallel_attributes(m.weight, True, 0, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    class Wrapper:  # Megatron's optimizer wrapper keeps the torch optimizer in .optimizer
        optimizer = opt

    for o in (Wrapper(), opt):
        utils.print_params_min_max_norm(o, 7)
        lines = capsys.readouterr().out.strip().splitlines()
        assert lines[0] == "iteration, rank, index, tensor-model-parallel, min, max, norm"
        for i, (line, p) in enumerate(zip(lines[1:], (m.weight, m.bias)), start=1):
            it, rank, index, tp, lo, hi, norm = (f.strip() for f in line.split(","))
            assert (int(it), int(rank), int(index), int(tp)) == (7, 0, i, int(p is m.weight))
            d = p.detach().double()
            assert float(lo) == pytest.approx(float(d.min()), rel=1e-6)
            assert float(hi) == pytest.approx(float(d.max()), rel=1e-6)
            assert float(norm) == pytest.approx(float(d.norm()), rel=1e-6)
        assert len(lines) == 3
    with pytest.raises(AttributeError, match="optimizer must be a torch.optim.Optimizer.*got NoneType"):
        utils.print_params_min_max_norm(None, 7)


def test_timers():
    from apex.transformer.pipeline_parallel._timers import _Timers

    timers = _Timers()
    timers("a").start()
    with pytest.raises(RuntimeError, match="already been started"):
        timers("a").start()
    timers("a").stop()
    assert timers("a").elapsed(reset=True) >= 0.0
    assert timers("a").elapsed() == 0.0
    with pytest.raises(RuntimeError, match="not started"):
        timers("b").stop()


def test_weight_decay_groups():
    from apex.normalization import FusedLayerNorm
    from apex.transformer.pipeline_parallel.schedules.common import _get_params_for_weight_decay_optimization

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), FusedLayerNorm(3))
    decay, no_decay = _get_params_for_weight_decay_optimization(model)
    assert [id(p) for p in decay["params"]] == [id(model[0].weight)]
    assert {id(p) for p in no_decay["params"]} == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}
    assert no_decay["weight_decay"] == 0.0
