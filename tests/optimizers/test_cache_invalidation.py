"""A step reuses what it read of the param groups at an earlier step (a plan per group, and the device
tables of the tensors' addresses, see ``apex/optimizers/_plan.py``). Every change that a reused plan or
table would get wrong must be noticed: each case below changes something between steps, then compares the
step with the same step of a fresh copy of the optimizer (``copy.deepcopy`` keeps no plan), value for value.
A stale table is a wrong update, not a slowdown: where the old tensors could still be written, the test
keeps them alive, so that a stale address writes into them instead of into freed memory.
"""

import copy

import pytest
import torch

import apex
from apex.testing import TritonTrace
from tests.optimizers._common import FUSED_OPTIMIZERS, grads_for_step, make_params

SHAPES = [(33,), (4097,), (3, 5)]

OPTIMIZERS = FUSED_OPTIMIZERS
# NovoGrad keeps one running norm per parameter with a gradient and refuses a step where that set changed.
FIXED_SET = {"FusedNovoGrad"}


def _set_grads(params, step):
    for p, g in zip(params, grads_for_step(params, step)):
        p.grad = g


def _fresh_twin(opt):
    """A copy of ``opt`` with no plan and no cached table, its parameters holding copies of the gradients."""
    twin = copy.deepcopy(opt)
    for group, tgroup in zip(opt.param_groups, twin.param_groups):
        for p, tp in zip(group["params"], tgroup["params"]):
            # (in its parameter's shape: a gradient reshaped behind the setter's back is read in flat order)
            tp.grad = None if p.grad is None else p.grad.detach().clone().reshape(tp.shape)
    return twin


def _step_both_and_compare(opt):
    twin = _fresh_twin(opt)
    opt.step()
    twin.step()
    for group, tgroup in zip(opt.param_groups, twin.param_groups):
        for p, tp in zip(group["params"], tgroup["params"]):
            assert torch.equal(p.detach(), tp.detach())
    for st, tst in zip(opt.state.values(), twin.state.values()):
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, tst[key]), key


def _change_new_gradient_tensor(opt, params, keep):
    keep.append(params[1].grad)  # the old gradient stays alive (and different): a stale table would read it
    params[1].grad = torch.randn_like(params[1]) * 3


def _change_gradient_data(opt, params, keep):
    keep.append(params[0].grad.data)
    params[0].grad.data = torch.randn_like(params[0]) * 3  # same tensor object, new storage


def _change_gradient_reshaped(opt, params, keep):
    # Same number of elements in another shape, behind the setter's back: updated in flat order (Apex's
    # engine checks sizes only), on every backend.
    keep.append(params[2].grad.data)
    params[2].grad.data = (torch.randn_like(params[2]) * 3).reshape(5, 3)


def _change_gradient_strided(opt, params, keep):
    # A new gradient of its parameter's dtype and shape, not contiguous: the kernels read it in flat order,
    # so it must not pass as the contiguous gradients the plan was made with.
    keep.append(params[2].grad)
    params[2].grad = (torch.randn(params[2].shape[::-1], dtype=params[2].dtype) * 3).t()


def _change_parameter_data(opt, params, keep):
    keep.append(params[1].data)
    params[1].data = params[1].data.clone() + 0.5  # what module.to() and friends do


def _change_gradient_to_none(opt, params, keep):
    params[2].grad = None


def _change_parameter_list(opt, params, keep):
    extra = torch.nn.Parameter(torch.randn(7, dtype=params[0].dtype))
    extra.grad = torch.randn_like(extra)
    opt.param_groups[0]["params"].append(extra)
    keep.append(extra)


def _change_param_group_added(opt, params, keep):
    extra = torch.nn.Parameter(torch.randn(9, dtype=params[0].dtype))
    extra.grad = torch.randn_like(extra)
    opt.add_param_group({"params": [extra]})
    keep.append(extra)


def _change_loaded_state(opt, params, keep):
    # The state of an optimizer trained on other gradients: the next step must use its tensors.
    other_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = type(opt).__new__(type(opt))
    other.__setstate__(copy.deepcopy(opt.__getstate__()))
    other.param_groups[0]["params"] = other_params
    other.state = type(opt.state)(dict)
    for p, q in zip(params, other_params):
        other.state[q] = copy.deepcopy(opt.state[p])
    other._plans = {}
    for s in (11, 12):
        for q, g in zip(other_params, grads_for_step(other_params, s, seed=5)):
            q.grad = g
        other.step()
    opt.load_state_dict(other.state_dict())


def _change_step_written_in_place(opt, params, keep):
    for p in params:
        step = opt.state[p].get("step")
        if isinstance(step, torch.Tensor):
            step.fill_(7.0)  # a view of the optimizer's packed counters: the next step counts from here
    group_step = opt.param_groups[0].get("step")
    if isinstance(group_step, torch.Tensor):
        group_step.fill_(7)


CHANGES = {
    "new_gradient_tensor": _change_new_gradient_tensor,
    "gradient_data_swapped": _change_gradient_data,
    "gradient_reshaped": _change_gradient_reshaped,
    "gradient_strided": _change_gradient_strided,
    "parameter_data_swapped": _change_parameter_data,
    "gradient_set_to_none": _change_gradient_to_none,
    "parameter_list_changed": _change_parameter_list,
    "param_group_added": _change_param_group_added,
    "state_loaded": _change_loaded_state,
    "step_written_in_place": _change_step_written_in_place,
}


@pytest.mark.parametrize("change", CHANGES)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_change_between_steps_is_seen(backend_name, name, change):
    if name in FIXED_SET and change in ("gradient_set_to_none", "parameter_list_changed"):
        pytest.skip("FusedNovoGrad refuses a step whose set of parameters with gradients changed (tested there)")
    dtype = torch.bfloat16 if name == "FusedMixedPrecisionLamb" else torch.float32
    params = make_params(SHAPES, dtype)
    opt = OPTIMIZERS[name](params)
    keep: list = []
    for s in range(3):  # the plan is made at the first step and reused by the next two
        _set_grads(params, s)
        opt.step()
    _set_grads(params, 3)
    CHANGES[change](opt, params, keep)
    _step_both_and_compare(opt)
    if change == "gradient_set_to_none":  # ... and back: the parameter joins its plan again
        _set_grads(params, 4)
        _step_both_and_compare(opt)
    _set_grads(opt.param_groups[0]["params"], 5)
    _step_both_and_compare(opt)  # the plan made after the change is right too


@pytest.mark.parametrize("name", ["FusedAdam", "FusedSGD", "FusedAdagrad"])
def test_one_launch_per_dtype_group_after_the_first_step(triton_device, name):
    pytest.importorskip("triton")
    params = make_params(SHAPES) + make_params(SHAPES, torch.bfloat16, seed=3)
    opt = OPTIMIZERS[name](params)
    for s in range(3):
        _set_grads(params, s)
        with apex.backend("triton"), TritonTrace(bounds=False) as tr:
            opt.step()
        assert tr.launches == 2, (s, tr.kernels)  # fp32 and bf16, at the first step and with a plan


def _assert_unchanged(params, opt, before) -> None:
    """The parameters and every state tensor equal ``before = (parameter copies, deep-copied state_dict)``."""
    for p, q in zip(params, before[0]):
        assert torch.equal(p.detach(), q)
    for k, st in opt.state_dict()["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, before[1]["state"][k][key]), key


@pytest.mark.no_triton_launch("refused before any launch")
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_gradient_moved_to_another_device_is_refused(triton_device, name):
    # ``grad.data = t`` takes a tensor of any dense device (``module.cpu()`` relies on it), and a new gradient
    # tensor is checked by the plan's reads, not by the first step's checks: the device must be one of them (a
    # kernel given a host address as a GPU one faults).
    if triton_device.type == "cpu":
        pytest.skip("needs a second device type: runs with the GPU under APEX_TEST_DEVICE=cuda")
    dtype = torch.bfloat16 if name == "FusedMixedPrecisionLamb" else torch.float32
    params = make_params(SHAPES, dtype)
    opt = OPTIMIZERS[name](params)
    with apex.backend("triton"):
        for s in range(3):
            _set_grads(params, s)
            opt.step()
        _set_grads(params, 3)
        params[1].grad.data = torch.randn(params[1].shape, dtype=dtype, device="cpu")
        before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
        with pytest.raises(RuntimeError):
            opt.step()
    _assert_unchanged(params, opt, before)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_gradient_of_another_dtype_is_refused(backend_name, name):
    # ``grad.data = t`` takes a tensor of any dtype: a new gradient tensor is checked by the plan's reads, and
    # the step must fail as the first step's checks fail, changing nothing.
    dtype = torch.bfloat16 if name == "FusedMixedPrecisionLamb" else torch.float32
    params = make_params(SHAPES, dtype)
    opt = OPTIMIZERS[name](params)
    for s in range(3):
        _set_grads(params, s)
        opt.step()
    _set_grads(params, 3)
    params[1].grad.data = torch.randn(params[1].shape, dtype=torch.float64)
    before = [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())
    with pytest.raises(RuntimeError, match="dtype|float64"):
        opt.step()
    _assert_unchanged(params, opt, before)


# -- FusedAdam's and FusedSGD's direct launches --------------------------------------------------------------
# With apex's own op on the Triton backend, FusedAdam and FusedSGD launch their kernel themselves, holding
# each launch's tables while the gradients' addresses repeat (gradients written in place). What they hold must
# never stand in for what a step reads: the hyper-parameters of param_groups, a gradient at a new address,
# the backend, the op.
ADAMS = ("FusedAdam", "FusedAdam-capturable-master")
DIRECT = ADAMS + ("FusedSGD",)


def _fill_grads(params, step):
    for p, g in zip(params, grads_for_step(params, step)):
        p.grad.copy_(g)  # the same gradient tensors, written in place: their addresses repeat


def _hyper_lr(opt, params, keep):
    group = opt.param_groups[0]
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(0.05)  # (as an lr scheduler sets a capturable optimizer's lr)
    else:
        group["lr"] = 0.05


def _hyper_lr_tensor_replaced(opt, params, keep):
    group = opt.param_groups[0]
    keep.append(group["lr"])
    group["lr"] = torch.full_like(group["lr"], 0.03) if isinstance(group["lr"], torch.Tensor) else 0.03


def _hyper_betas_eps_weight_decay(opt, params, keep):
    opt.param_groups[0].update(betas=(0.8, 0.99), eps=1e-3, weight_decay=0.2)


def _hyper_no_bias_correction(opt, params, keep):
    opt.param_groups[0]["bias_correction"] = False


def _adam_mode_switched(opt, params, keep):
    opt.adam_w_mode = 0


def _sgd_hyper(opt, params, keep):
    opt.param_groups[0].update(momentum=0.5, dampening=0.25, weight_decay=0.2)


def _sgd_nesterov(opt, params, keep):
    opt.param_groups[0].update(dampening=0.0, nesterov=True)


FAST_CHANGES = {
    "lr": _hyper_lr,
    "lr_replaced": _hyper_lr_tensor_replaced,
    "betas_eps_weight_decay": _hyper_betas_eps_weight_decay,
    "bias_correction_off": _hyper_no_bias_correction,
    "adam_mode": _adam_mode_switched,
    "sgd_momentum_dampening_weight_decay": _sgd_hyper,
    "sgd_nesterov": _sgd_nesterov,
    "new_gradient_tensor": _change_new_gradient_tensor,  # same shape, another address
    "gradient_data_swapped": _change_gradient_data,
    "parameter_data_swapped": _change_parameter_data,
}


SHARED_CHANGES = ("lr", "lr_replaced", "new_gradient_tensor", "gradient_data_swapped", "parameter_data_swapped")


def _adam_steps_in_place(name, steps=3):
    params = make_params(SHAPES) + make_params(SHAPES, torch.bfloat16, seed=3)
    opt = OPTIMIZERS[name](params)
    _set_grads(params, 0)
    for s in range(steps):  # the first step plans; the next ones launch with the tables they hold
        _fill_grads(params, s)
        opt.step()
    return params, opt


@pytest.mark.parametrize("change", FAST_CHANGES)
@pytest.mark.parametrize("name", DIRECT)
def test_direct_launch_sees_a_change(backend_name, name, change):
    if change.startswith("sgd") != (name == "FusedSGD") and change not in SHARED_CHANGES:
        pytest.skip("another optimizer's option")
    params, opt = _adam_steps_in_place(name)
    keep: list = []
    _fill_grads(params, 3)
    FAST_CHANGES[change](opt, params, keep)
    _step_both_and_compare(opt)
    _fill_grads(params, 4)
    _step_both_and_compare(opt)  # and at the step after it, with what the changed step held


@pytest.mark.parametrize("name", DIRECT)
def test_launches_itself_at_a_repeated_step(triton_device, name, monkeypatch):
    # The op layers (checks, backend choice, grouping, table lookup) are skipped for apex's own op; the launch
    # per (dtype) group stays one.
    pytest.importorskip("triton")
    import apex._kernels.multi_tensor_sgd as sgd_kernels
    import apex.ops.multi_tensor_adam as ops

    calls = []
    where, attr = (sgd_kernels, "sgd") if name == "FusedSGD" else (ops, "_adam")  # (the op's Triton path)
    real = getattr(where, attr)
    monkeypatch.setattr(where, attr, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    with apex.backend("triton"):
        params, opt = _adam_steps_in_place(name)
        for s in range(3, 5):
            _fill_grads(params, s)
            with TritonTrace(bounds=False) as tr:
                opt.step()
            assert tr.launches == 2, tr.kernels
    assert calls == []
    with apex.backend("triton"):
        setattr(opt, "multi_tensor_sgd" if name == "FusedSGD" else "multi_tensor_adam", lambda *a, **k: calls.append(1))
        if "capturable" in name:
            opt.multi_tensor_adam_capturable = opt.multi_tensor_adam_capturable_master = opt.multi_tensor_adam
        _fill_grads(params, 5)
        opt.step()
    assert len(calls) == 2  # an op swapped in is called, per group


@pytest.mark.parametrize("name", DIRECT)
def test_backend_switched_between_steps(triton_device, name):
    pytest.importorskip("triton")
    with apex.backend("triton"):
        params, opt = _adam_steps_in_place(name)
    for backend, s in (("torch", 3), ("triton", 4), ("torch", 5)):
        _fill_grads(params, s)
        twin = _fresh_twin(opt)
        with apex.backend(backend), TritonTrace(bounds=False) as tr:
            opt.step()
            twin.step()
        assert tr.launches == (0 if backend == "torch" else 4), (backend, tr.kernels)
        for p, tp in zip(params, twin.param_groups[0]["params"]):
            assert torch.equal(p.detach(), tp.detach())


@pytest.mark.parametrize("name", DIRECT)
def test_op_swapped_between_steps_is_called(backend_name, name):
    params, opt = _adam_steps_in_place(name)
    attr = ("multi_tensor_sgd" if name == "FusedSGD" else
            "multi_tensor_adam_capturable_master" if "capturable" in name else "multi_tensor_adam")
    real, seen = getattr(opt, attr), []

    def swapped(*args, **kwargs):
        seen.append(len(args[2][0]))
        return real(*args, **kwargs)

    _fill_grads(params, 3)
    twin = _fresh_twin(opt)
    setattr(opt, attr, swapped)
    opt.step()
    twin.step()
    for p, tp in zip(params, twin.param_groups[0]["params"]):
        assert torch.equal(p.detach(), tp.detach())
    if "capturable" in name:  # (its fp32 parameters have no master: they go through the plain capturable op)
        assert seen == [3]
    else:
        assert seen == [3, 3]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_gradients_alternating_between_two_sets(backend_name, name):
    # Two sets of gradient tensors, both kept alive, given in turn (as when each step's new gradients take the
    # memory the step before last freed): a step reuses the tables of the step before last; then a set equal
    # to one of them but for one gradient, which must not.
    dtype = torch.bfloat16 if name == "FusedMixedPrecisionLamb" else torch.float32
    params = make_params(SHAPES, dtype)
    opt = OPTIMIZERS[name](params)
    sets = [grads_for_step(params, s) for s in range(2)]
    for s in range(5):
        for p, g in zip(params, sets[s % 2]):
            p.grad = g
            g.mul_(0.5)  # (other values at every step)
        _step_both_and_compare(opt)
    moved = sets[0][1]
    sets[0][1] = moved.clone() * 3  # `moved` stays alive: a stale table would read it
    for p, g in zip(params, sets[0]):
        p.grad = g
    _step_both_and_compare(opt)
    for p, g in zip(params, sets[1]):
        p.grad = g
    _step_both_and_compare(opt)
