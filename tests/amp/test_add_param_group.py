"""A parameter group added after ``amp.initialize`` trains exactly as if it had been there from the start
(Apex patches ``add_param_group``: masters for its half parameters, unscaled gradients)."""

import pytest
import torch
import torch.nn.functional as F

from apex import amp
from tests.amp._models import mlp, mlp_data


def _run(opt_level: str, late: bool, steps: int = 4):
    first, second = mlp(seed=0), mlp(seed=1)
    with torch.no_grad():
        # Values that fp16 and bf16 both hold: masters made at initialize start from the fp32 values, those
        # made by a later add_param_group from the half copy (the fp32 values are gone by then).
        for p in list(first.parameters()) + list(second.parameters()):
            p.copy_(p.to(torch.bfloat16).to(torch.float16).float())
    if late:
        opt = torch.optim.SGD(first.parameters(), lr=0.05, momentum=0.9)
    else:
        opt = torch.optim.SGD([{"params": list(first.parameters())}, {"params": list(second.parameters()),
                                                                         "lr": 0.02}], lr=0.05, momentum=0.9)
    [first, second], opt = amp.initialize([first, second], opt, opt_level=opt_level, verbosity=0)
    if late:
        opt.add_param_group({"params": second.parameters(), "lr": 0.02})
    x, y = mlp_data()
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(first(x), y) + F.cross_entropy(second(x), y)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
    return first, second, opt


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_group_added_after_initialize_trains_like_one_given_at_the_start(opt_level):
    ref = _run(opt_level, late=False)
    ours = _run(opt_level, late=True)
    for a, b in zip(list(ref[0].parameters()) + list(ref[1].parameters()),
                    list(ours[0].parameters()) + list(ours[1].parameters())):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    masters = list(amp.master_params(ours[2]))
    assert len(masters) == len(list(amp.master_params(ref[2])))
    if opt_level == "O2":  # the new group holds fp32 masters of the half parameters
        assert all(p.dtype == torch.float32 for p in ours[2].param_groups[1]["params"])
        sd = ours[1].state_dict()  # and the model saves them
        for (name, _p), m in zip(ours[1].named_parameters(), ours[2].param_groups[1]["params"]):
            assert torch.equal(sd[name], m.detach())


def test_add_param_group_rejects_a_set_and_other_dtypes():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="ordered collections"):
        opt.add_param_group({"params": {torch.nn.Parameter(torch.ones(2))}})
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1


def test_add_param_group_rejects_a_parameter_already_optimized():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    masters_before = len(list(amp.master_params(opt)))
    with pytest.raises(ValueError, match="more than one parameter group"):
        opt.add_param_group({"params": [model[0].weight]})  # a half parameter whose master is optimized
    assert len(opt.param_groups) == 1 and len(list(amp.master_params(opt))) == masters_before
