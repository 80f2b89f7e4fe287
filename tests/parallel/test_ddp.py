"""apex.parallel.DistributedDataParallel and Reducer on 2 and 3 Gloo ranks.

Every option is checked against single-process gradients of the concatenated batch: with per-rank losses
``loss_r`` (means over equal local batches), DDP's averaged gradient must equal the gradient of
``Σ_r loss_r / world_size`` computed in one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from apex.parallel import DistributedDataParallel as DDP
from apex.parallel import Reducer
from apex.testing import rel_error, run_distributed

FEAT, HID, OUT, BATCH = 12, 16, 5, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(FEAT, HID)
        self.fc2 = nn.Linear(HID, HID)
        self.head = nn.Linear(HID, OUT)
        self.extra = nn.Linear(HID, OUT)   # used only when the caller asks (rank-dependent)
        self.unused = nn.Linear(HID, OUT)  # never used: its gradient stays None everywhere

    def forward(self, x, use_extra=False):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        out = self.head(h)
        if use_extra:
            out = out + self.extra(h)
        return out


def _data(step, world):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * BATCH, FEAT, generator=g)
    y = torch.randn(world * BATCH, OUT, generator=g)
    return x, y


def _loss(model, x, y, use_extra):
    return ((model(x, use_extra) - y) ** 2).mean()


def _extra_flag(rank, step):
    return (rank + step) % 2 == 0


def _reference_grads(base, step, world, scale=1.0):
    """Gradient of Σ_r loss_r / world in one process (None where no rank produced a gradient)."""
    ref = copy.deepcopy(base)
    ref.zero_grad(set_to_none=True)
    x, y = _data(step, world)
    total = 0
    for r in range(world):
        sl = slice(r * BATCH, (r + 1) * BATCH)
        total = total + _loss(ref, x[sl], y[sl], _extra_flag(r, step))
    (total * scale / world).backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in ref.named_parameters()}


def _check_grads(model, ref, what):
    for n, p in model.named_parameters():
        if ref[n] is None:
            assert p.grad is None, f"{what}: {n} should have no gradient"
            continue
        assert p.grad is not None, f"{what}: {n} has no gradient"
        err = rel_error(p.grad, ref[n])
        assert err <= 1e-6, f"{what}: {n} rel err {err}"


OPTIONS = [
    ("default", {}),
    ("many_buckets", {"message_size": 1}),
    ("mid_buckets", {"message_size": 300}),
    ("delay", {"delay_allreduce": True}),
    ("triggers", "triggers"),
    ("retain", {"retain_allreduce_buffers": True, "message_size": 200}),
    ("fp32", {"allreduce_always_fp32": True, "message_size": 100}),
    ("streams", {"num_allreduce_streams": 2, "message_size": 100}),
    ("no_average", {"gradient_average": False}),
    ("predivide", {"gradient_predivide_factor": 2.0, "message_size": 50}),
    ("predivide_no_avg", {"gradient_predivide_factor": 4.0, "gradient_average": False}),
    ("prof", {"prof": True}),
    ("split_factor", {"gradient_average_split_factor": 3.0, "message_size": 100}),
]


def _ddp_options_worker(rank, world):
    torch.manual_seed(0)
    base = Net()
    for name, kwargs in OPTIONS:
        torch.manual_seed(rank + 7)  # different init per rank: construction must broadcast rank 0's
        local = Net()
        if kwargs == "triggers":
            kwargs = {"allreduce_trigger_params": [local.fc2.weight, local.fc1.bias]}
        if rank == 0:
            local.load_state_dict(base.state_dict())
        model = DDP(local, **kwargs)
        for n, p in local.named_parameters():
            assert torch.equal(p, dict(base.named_parameters())[n]), f"{name}: {n} not broadcast"
        # Without averaging the result is Σ_r grad_r / predivide = world / predivide * the average.
        scale = 1.0
        if kwargs.get("gradient_average") is False:
            scale = world / kwargs.get("gradient_predivide_factor", 1.0)
        for step in range(3):
            local.zero_grad(set_to_none=True)
            x, y = _data(step, world)
            sl = slice(rank * BATCH, (rank + 1) * BATCH)
            _loss(model, x[sl], y[sl], _extra_flag(rank, step)).backward()
            _check_grads(local, _reference_grads(base, step, world, scale), f"{name} step {step}")
        if name == "many_buckets":
            n_active = sum(1 for p in local.parameters())
            assert model.num_buckets == n_active, (model.num_buckets, n_active)
        if name == "triggers":
            assert model.num_buckets >= 2
        if name == "retain":
            assert all(b is not None for b in model.allreduce_buffers)
        if name == "delay":
            assert model.num_buckets == 1


def _ddp_training_worker(rank, world):
    """Refresh on a requires_grad change, accumulation with disable/enable, 5 SGD steps in sync."""
    torch.manual_seed(0)
    base = Net()
    local = copy.deepcopy(base)
    model = DDP(local, message_size=64)
    # Gradient accumulation: pass A without reduction, pass B with it.
    model.disable_allreduce()
    xa, ya = _data(10, world)
    xb, yb = _data(11, world)
    sl = slice(rank * BATCH, (rank + 1) * BATCH)
    _loss(model, xa[sl], ya[sl], False).backward()
    model.enable_allreduce()
    _loss(model, xb[sl], yb[sl], False).backward()
    ref = copy.deepcopy(base)
    total = sum(_loss(ref, xa[r * BATCH:(r + 1) * BATCH], ya[r * BATCH:(r + 1) * BATCH], False)
                + _loss(ref, xb[r * BATCH:(r + 1) * BATCH], yb[r * BATCH:(r + 1) * BATCH], False)
                for r in range(world))
    (total / world).backward()
    _check_grads(local, {n: p.grad for n, p in ref.named_parameters()}, "accumulation")

    # The set of trainable parameters changes: buckets are rebuilt and still give exact gradients.
    local.zero_grad(set_to_none=True)
    before = model.num_buckets
    local.fc1.weight.requires_grad_(False)
    base_frozen = copy.deepcopy(base)
    base_frozen.fc1.weight.requires_grad_(False)
    for step in range(2):
        local.zero_grad(set_to_none=True)
        x, y = _data(20 + step, world)
        _loss(model, x[sl], y[sl], _extra_flag(rank, 20 + step)).backward()
        _check_grads(local, _reference_grads(base_frozen, 20 + step, world), f"frozen step {step}")
    assert model.num_buckets <= before and len(model.active_params) == 9
    local.fc1.weight.requires_grad_(True)

    # Five SGD steps keep every rank's parameters identical.
    opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        opt.zero_grad()
        x, y = _data(30 + step, world)
        _loss(model, x[sl], y[sl], _extra_flag(rank, step)).backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in local.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    for g in gathered[1:]:
        assert torch.equal(g, gathered[0]), "ranks diverged after 5 SGD steps"
    assert not torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in base.parameters()]))

    # Overlap: after the first (structure-building) pass, every full bucket is launched during backward.
    calls = model.allreduce_calls
    x, y = _data(40, world)
    in_flight = []
    # fc1's weight gets its gradient last; by then earlier buckets' all-reduces must already be running.
    handle = local.fc1.weight.register_post_accumulate_grad_hook(
        lambda p: in_flight.append(len(model._step.pending)))
    _loss(model, x[sl], y[sl], True).backward()
    handle.remove()
    assert model.num_buckets >= 3 and in_flight and in_flight[0] >= model.num_buckets - 2, in_flight
    assert model.allreduce_calls - calls == model.num_buckets

    # Reducer: exact average of a list of tensors and of a module's gradients.
    t = torch.arange(6, dtype=torch.float64) * (rank + 1)
    u = [torch.full((3,), float(rank)), torch.full((2, 2), float(rank * rank))]
    red = Reducer([t, u])
    red.reduce()
    assert torch.equal(t, torch.arange(6, dtype=torch.float64) * (world + 1) / 2)
    assert torch.allclose(u[0], torch.full((3,), (world - 1) / 2), rtol=0, atol=1e-7)
    mean_sq = sum(r * r for r in range(world)) / world
    assert torch.allclose(u[1], torch.full((2, 2), mean_sq), rtol=0, atol=1e-6)
    torch.manual_seed(rank)
    m = nn.Linear(3, 2)
    r2 = Reducer(m)
    w0 = m.weight.detach().clone()
    gathered = [torch.empty_like(w0) for _ in range(world)]
    dist.all_gather(gathered, w0)
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    m(torch.full((1, 3), float(rank + 1))).sum().backward()
    r2.reduce()
    assert torch.allclose(m.weight.grad, torch.full((2, 3), (world + 1) / 2), rtol=1e-6)


class MixedNet(nn.Module):
    """fp32, bf16 and fp16 parameters side by side: buckets must never mix dtypes."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(FEAT, OUT)
        self.b = nn.Linear(FEAT, OUT).to(torch.bfloat16)
        self.c = nn.Linear(FEAT, OUT).to(torch.float16)

    def forward(self, x, use_extra=False):
        return self.a(x) + self.b(x.bfloat16()).float() + self.c(x.half()).float()


def _ddp_mixed_dtype_worker(rank, world):
    torch.manual_seed(0)
    base = MixedNet()
    for kwargs in ({}, {"message_size": 1}, {"allreduce_always_fp32": True, "message_size": 1},
                   {"delay_allreduce": True}):
        local = copy.deepcopy(base)
        model = DDP(local, **kwargs)
        for step in range(2):
            local.zero_grad(set_to_none=True)
            x, y = _data(step, world)
            sl = slice(rank * BATCH, (rank + 1) * BATCH)
            _loss(model, x[sl], y[sl], False).backward()
            ref = copy.deepcopy(base)
            total = sum(_loss(ref, x[r * BATCH:(r + 1) * BATCH], y[r * BATCH:(r + 1) * BATCH], False)
                        for r in range(world))
            (total / world).backward()
            for (n, p), q in zip(local.named_parameters(), ref.parameters()):
                assert p.grad.dtype == p.dtype
                # Low-precision gradients: each rank's own rounding, then the sum's, against one process.
                tol = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 3e-3}[p.dtype]
                err = rel_error(p.grad, q.grad)
                assert err <= tol, f"{kwargs} {n}: rel err {err}"
        dtypes = [{local_p.dtype for local_p in (model.active_params[i] for i in b)}
                  for b in model.active_i_buckets]
        assert all(len(d) == 1 for d in dtypes), dtypes
        assert model.num_buckets >= 3


def _ddp_worker(rank, world):
    # One spawn per world size: starting ranks costs seconds, the checks themselves milliseconds.
    _ddp_options_worker(rank, world)
    _ddp_training_worker(rank, world)
    _ddp_mixed_dtype_worker(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_every_option_training_accumulation_refresh_and_reducer(world, dist_device):
    # on a GPU: the buckets are all-reduced on CUDA tensors, from side streams with num_allreduce_streams
    run_distributed(_ddp_worker, world, device=dist_device)


def test_ddp_bad_input_without_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        DDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="shared_param"):
        DDP(nn.Linear(2, 2), shared_param=True)
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="allreduce_trigger_params"):
        DDP(lin, delay_allreduce=True, allreduce_trigger_params=[lin.weight])
    with pytest.raises(ValueError, match="num_allreduce_streams"):
        DDP(lin, num_allreduce_streams=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Reducer(lin)
