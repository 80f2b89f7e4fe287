"""FusedAdam's Apex-side state: the group step count and ``param_groups_master``, as Megatron-LM's
distributed optimizer checkpoints and NeMo's ``MegatronFusedAdam`` use them."""

from __future__ import annotations

import copy

import pytest
import torch

from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedAdam
from apex.testing import rel_error
from tests.optimizers._common import clone_params, grads_for_step, make_params, set_grads


def _train(opt, params, steps, start=0):
    for s in range(start, start + steps):
        set_grads(params, grads_for_step(params, s))
        opt.step()


@pytest.mark.parametrize("capturable", [False, True])
def test_group_step_counts_steps_in_apex_form(backend_name, capturable):
    params = make_params([(5,), (3, 2)])
    idle = torch.nn.Parameter(torch.randn(4))  # a group whose parameter never has a gradient
    opt = FusedAdam([{"params": params}, {"params": [idle]}], lr=1e-2, capturable=capturable)
    assert "step" not in opt.param_groups[0]
    _train(opt, params, 4)
    for group in opt.param_groups:  # Apex counts every step call, for every non-empty group
        step = group["step"]
        if capturable:
            assert isinstance(step, torch.Tensor) and step.dtype == torch.int32 and step.tolist() == [4]
        else:
            assert type(step) is int and step == 4
    assert float(opt.state[params[0]]["step"]) == 4  # and PyTorch's per-parameter count
    assert not opt.state.get(idle)


def test_capturable_group_step_does_not_count_a_skipped_step():
    params = make_params([(5,)])
    opt = FusedAdam(params, lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for bad in (False, True, False):
        params[0].grad = torch.randn(5) * 4.0
        if bad:
            params[0].grad[2] = float("inf")
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
    assert opt.param_groups[0]["step"].tolist() == [2]
    assert float(opt.state[params[0]]["step"]) == 2


@pytest.mark.parametrize("saved_step", ["int", "capturable tensor"])
def test_checkpoint_with_only_the_group_step_resumes(saved_step):
    """Megatron-LM's distributed optimizer saves the param groups (with Apex's ``step``) and each
    parameter's ``exp_avg``/``exp_avg_sq`` only; Apex's capturable checkpoints hold the step as a tensor."""
    params = make_params([(10,), (4, 3)])
    ours = FusedAdam(params, lr=1e-2, weight_decay=0.1)
    _train(ours, params, 5)
    sd = ours.state_dict()
    saved = {
        "state": {i: {k: st[k].clone() for k in ("exp_avg", "exp_avg_sq")} for i, st in sd["state"].items()},
        "param_groups": copy.deepcopy(sd["param_groups"]),
    }
    assert saved["param_groups"][0]["step"] == 5
    if saved_step != "int":
        saved["param_groups"][0]["step"] = torch.tensor([5], dtype=torch.int32)
    twins = clone_params(params)
    resumed = FusedAdam(twins, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(saved)
    assert resumed.param_groups[0]["step"] == 5
    _train(ours, params, 3, start=5)
    _train(resumed, twins, 3, start=5)
    for a, b in zip(params, twins):
        assert torch.equal(a, b)
    assert resumed.param_groups[0]["step"] == 8


def test_torch_checkpoint_gives_the_group_step():
    params = make_params([(6,)])
    adamw = torch.optim.AdamW(params, lr=1e-2)
    _train(adamw, params, 3)
    ours = FusedAdam(clone_params(params), lr=1e-2, capturable=True)
    ours.load_state_dict(copy.deepcopy(adamw.state_dict()))
    assert ours.param_groups[0]["step"].tolist() == [3]


@pytest.mark.parametrize("master_weights", [False, True])
def test_param_groups_master_mirrors_the_groups(master_weights):
    p16 = torch.nn.Parameter(torch.randn(7).half())
    pbf = torch.nn.Parameter(torch.randn(3, 2).bfloat16())
    p32 = torch.nn.Parameter(torch.randn(5))
    opt = FusedAdam([{"params": [p16, p32]}, {"params": [pbf]}], lr=1e-2, master_weights=master_weights)
    extra = torch.nn.Parameter(torch.randn(2).half())
    opt.add_param_group({"params": [extra]})
    masters = [g["params"] for g in opt.param_groups_master]
    assert [len(m) for m in masters] == [2, 1, 1]
    if not master_weights:
        assert all(m is None for row in masters for m in row)
        return
    (m16, m32), (mbf,), (mextra,) = masters
    assert m32 is p32  # an fp32 parameter is its own master
    for m, p in ((m16, p16), (mbf, pbf), (mextra, extra)):
        assert m.dtype == torch.float32 and torch.equal(m, p.detach().float())
    for p in (p16, pbf, p32, extra):
        p.grad = torch.randn_like(p)
    opt.step()
    # the step updated those same tensors, which the state now carries for checkpoints
    assert opt.state[p16]["master_param"] is m16 and opt.state[pbf]["master_param"] is mbf
    assert torch.equal(p16.detach(), m16.half()) and not torch.equal(m16, m16.half().float())


def test_master_made_at_construction_follows_weights_loaded_before_the_first_step():
    p = torch.nn.Parameter(torch.randn(9).half())
    q = torch.nn.Parameter(torch.randn(9).half())
    opt = FusedAdam([p, q], lr=1e-2, master_weights=True)
    loaded = torch.randn(9).half()
    with torch.no_grad():
        p.copy_(loaded)  # e.g. model.load_state_dict after the optimizer was built
    written = torch.randn(9)
    opt.param_groups_master[0]["params"][1].copy_(written)  # a master set on purpose is kept
    p.grad, q.grad = torch.zeros_like(p), torch.zeros_like(q)
    opt.step()
    assert torch.equal(opt.param_groups_master[0]["params"][0], loaded.float())
    assert torch.equal(opt.param_groups_master[0]["params"][1], written)
    assert torch.equal(q.detach(), written.half())


def test_loaded_masters_are_the_ones_param_groups_master_shows():
    params = make_params([(6,), (4,)], torch.float16)
    opt = FusedAdam(params, lr=1e-2, master_weights=True)
    _train(opt, params, 2)
    twins = clone_params(params)
    opt2 = FusedAdam(twins, lr=1e-2, master_weights=True)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q, m in zip(params, twins, opt2.param_groups_master[0]["params"]):
        assert m is opt2.state[q]["master_param"]
        assert torch.equal(m, opt.state[p]["master_param"])


class MegatronStyleFusedAdam(FusedAdam):
    """A subclass that runs its own step over ``param_groups_master`` with Apex's capturable-master op, as
    NeMo's ``MegatronFusedAdam`` does."""

    def step(self, closure=None, grad_scaler=None):
        for group, group_master in zip(self.param_groups, self.param_groups_master):
            device = group["params"][0].device
            if "step" in group:
                group["step"] += (self._dummy_overflow_buf != 1).to(torch.int)
            else:
                group["step"] = torch.tensor([1], dtype=torch.int, device=device)
            lists = [[], [], [], [], []]
            for p, p_master in zip(group["params"], group_master["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                for lst, t in zip(lists, (p.grad, p, state["exp_avg"], state["exp_avg_sq"], p_master)):
                    lst.append(t)
            beta1, beta2 = group["betas"]
            multi_tensor_applier(self.multi_tensor_adam_capturable_master, self._dummy_overflow_buf, lists,
                                 group["lr"], beta1, beta2, group["eps"], group["step"], self.adam_w_mode,
                                 1, group["weight_decay"], torch.ones(1, device=device))


def test_subclass_stepping_over_param_groups_master_matches_fp32_adamw(backend_name):
    gen = torch.Generator().manual_seed(0)
    p16 = torch.nn.Parameter(torch.randn(33, generator=gen).half())
    p32 = torch.nn.Parameter(torch.randn(5, generator=gen))
    ref = [torch.nn.Parameter(p16.detach().float()), torch.nn.Parameter(p32.detach().clone())]
    ours = MegatronStyleFusedAdam([p16, p32], lr=1e-2, weight_decay=0.1, capturable=True, master_weights=True)
    adamw = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        grads = [torch.randn(33, generator=gen).half(), torch.randn(5, generator=gen)]
        p16.grad, p32.grad = grads
        ref[0].grad, ref[1].grad = grads[0].float(), grads[1].clone()
        ours.step()
        adamw.step()
    assert ours.param_groups[0]["step"].tolist() == [4]
    assert rel_error(ours.param_groups_master[0]["params"][0], ref[0].detach()) <= 1e-6
    assert rel_error(p32.detach(), ref[1].detach()) <= 1e-6
    assert torch.equal(p16.detach(), ours.param_groups_master[0]["params"][0].half())


def test_a_parameter_getting_its_first_gradient_late_starts_at_step_one():
    """The group's count is Apex's bookkeeping; each parameter's bias correction counts its own steps, as
    in torch.optim.AdamW."""
    params = make_params([(5,), (3,)])
    twins = clone_params(params)
    ours = FusedAdam(params, lr=1e-2)
    ref = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.0)
    for step in range(6):
        grads = grads_for_step(params, step)
        for ps in (params, twins):
            set_grads(ps, grads)
            if step < 3:
                ps[1].grad = None  # the second parameter is frozen for the first three steps
        ours.step()
        ref.step()
    assert ours.param_groups[0]["step"] == 6 and float(ours.state[params[1]]["step"]) == 3
    for a, b in zip(params, twins):
        assert rel_error(a.detach(), b.detach()) <= 1e-6


@pytest.mark.parametrize("how", ["data", "copy_", "deepcopy"])
def test_a_master_set_before_the_first_step_is_kept(how):
    """Loading masters into ``param_groups_master`` (through ``.data`` as Apex-era code does, or in
    place), also in a copy of the optimizer made before its first step."""
    p = torch.nn.Parameter(torch.randn(4).bfloat16())
    opt = FusedAdam([p], lr=0.0, master_weights=True)
    precise = p.detach().float() + 1e-3  # not representable in bf16
    master = opt.param_groups_master[0]["params"][0]
    if how == "data":
        master.data.copy_(precise)
    else:
        with torch.no_grad():
            master.copy_(precise)
    if how == "deepcopy":
        opt = copy.deepcopy(opt)
        p = opt.param_groups[0]["params"][0]
    p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.equal(opt.param_groups_master[0]["params"][0], precise)
    assert opt.state[p]["master_param"] is opt.param_groups_master[0]["params"][0]


def test_capturable_group_without_grads_counts_only_the_steps_taken():
    a = torch.nn.Parameter(torch.randn(3))
    b = torch.nn.Parameter(torch.randn(3))
    opt = FusedAdam([{"params": [b]}, {"params": [a]}], lr=1e-2, capturable=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    counts = []
    for bad in (False, True, False):
        a.grad = torch.randn(3) * 4.0
        if bad:
            a.grad[0] = float("inf")
        scaler.scale(torch.ones(()))
        scaler.step(opt)
        scaler.update()
        counts.append([g["step"].item() for g in opt.param_groups])
    assert counts == [[1, 1], [1, 1], [2, 2]]
