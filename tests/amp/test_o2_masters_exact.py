"""O2's fp32 masters start from the fp32 parameters as they were before ``amp.initialize`` cast the model,
not from the half copy: a checkpoint loaded into the fp32 model and then passed to ``initialize`` resumes
from exactly its own values."""

import pytest
import torch

from apex import amp

HALVES = [torch.float16, torch.bfloat16]


def _model(seed):
    torch.manual_seed(seed)
    # Values whose low bits a half type cannot hold, so a master rebuilt from the half copy would differ.
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))


def _masters(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("half", HALVES)
def test_masters_equal_the_fp32_parameters_bit_for_bit(half):
    model = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", cast_model_type=half, verbosity=0)
    masters = _masters(optimizer)
    assert len(masters) == len(before)
    assert all(m.dtype == torch.float32 for m in masters)
    # The half model really lost bits, so the test can tell the two constructions apart.
    assert any(not torch.equal(b.to(half).float(), b) for b in before)
    for b, m in zip(before, masters):
        assert torch.equal(m, b)
    # model.state_dict() gives the masters: the original values come back unchanged.
    for b, v in zip(before, [v for k, v in model.state_dict().items() if "running" not in k and "num_b" not in k]):
        assert v.dtype == torch.float32 and torch.equal(v, b)


@pytest.mark.parametrize("half", HALVES)
def test_checkpoint_loaded_before_initialize_resumes_exactly(half):
    trained = _model(1)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    checkpoint = {k: v.clone() for k, v in trained.state_dict().items()}
    restored = _model(2)
    restored.load_state_dict(checkpoint)
    optimizer = torch.optim.SGD(restored.parameters(), lr=0.1)
    restored, optimizer = amp.initialize(restored, optimizer, opt_level="O2", cast_model_type=half, verbosity=0)
    state = restored.state_dict()
    for key, value in checkpoint.items():
        if value.is_floating_point():
            assert torch.equal(state[key], value), key


def test_masters_round_to_their_half_parameters():
    # Each master describes the half parameter it belongs to: rounding it gives that parameter back.
    model = _model(3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", cast_model_type=torch.float16,
                                      verbosity=0)
    half_params = [p for p in model.parameters() if p.dtype == torch.float16]
    for p, m in zip(half_params, optimizer._amp_stash.all_fp32_from_fp16_params):
        assert torch.equal(m.to(torch.float16), p)
