"""apex.parallel in one process: LARC against its formula, convert_syncbn_model, the public surface and
the errors raised without an initialised process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import apex.parallel as P
from apex.testing import assert_rel_close


def _larc_reference(params, grads_per_step, lr, momentum, wd, tc, clip, eps):
    """Plain-Python LARC around SGD with momentum, in float64."""
    ps = [p.detach().double().clone() for p in params]
    bufs = [None] * len(ps)
    history = []
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(ps, grads)):
            g = g.double().clone()
            pn, gn = p.norm().item(), g.norm().item()
            if pn != 0 and gn != 0:
                local = tc * pn / (gn + pn * wd + eps)
                factor = min(local / lr, 1.0) if clip else local
                g = (g + wd * p) * factor
            bufs[i] = g if bufs[i] is None else momentum * bufs[i] + g
            p -= lr * bufs[i]
        history.append([p.clone() for p in ps])
    return history


@pytest.mark.parametrize("clip", [True, False])
@pytest.mark.parametrize("wd", [0.0, 1e-2])
def test_larc_matches_its_formula_step_by_step(clip, wd):
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(7, 5)), nn.Parameter(torch.randn(13) * 0.01),
              nn.Parameter(torch.zeros(3))]  # a zero parameter keeps its plain SGD step
    # Gradient scales chosen so that clip=True hits both sides of min(local_lr / lr, 1).
    scales = [100.0, 1e-4, 1.0]
    steps = [[torch.randn_like(p) * s for p, s in zip(params, scales)] for _ in range(4)]
    lr, momentum, tc, eps = 0.1, 0.9, 0.02, 1e-8
    opt = P.LARC(torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd), trust_coefficient=tc,
                 clip=clip, eps=eps)
    ref = _larc_reference(params, steps, lr, momentum, wd, tc, clip, eps)
    for k, grads in enumerate(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        assert opt.param_groups[0]["weight_decay"] == wd  # handed back to the optimizer after the step
        for p, r in zip(params, ref[k]):
            assert_rel_close(p.detach(), r, tol=1e-6, name=f"step {k}")
    # The wrapper forwards the optimizer's API.
    sd = opt.state_dict()
    assert len(opt.state) == 3 and sd["param_groups"][0]["lr"] == lr
    opt.load_state_dict(sd)
    opt.zero_grad()
    assert all(p.grad is None for p in params)


def test_larc_defaults_and_import_spellings():
    from apex.parallel.LARC import LARC

    assert LARC is P.LARC
    opt = LARC(torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1))
    assert (opt.trust_coefficient, opt.clip, opt.eps) == (0.02, True, 1e-8)
    with pytest.raises(TypeError, match="optimizer"):
        LARC(object())


def test_public_surface():
    assert P.ReduceOp is dist.ReduceOp
    ts = [torch.randn(3, 2), torch.randn(5)]
    flat = P.flatten(ts)
    assert flat.shape == (11,)
    for a, b in zip(P.unflatten(flat, ts), ts):
        assert torch.equal(a, b)
    for name in ("DistributedDataParallel", "Reducer", "SyncBatchNorm", "convert_syncbn_model",
                 "create_syncbn_process_group", "LARC", "ReduceOp", "flatten", "unflatten", "apply_flat_dist_call"):
        assert hasattr(P, name), name
    from apex.parallel.distributed import flat_dist_call, split_half_float_double  # noqa: F401
    from apex.parallel.sync_batchnorm import SyncBatchNorm

    assert SyncBatchNorm is P.SyncBatchNorm
    from apex.parallel.optimized_sync_batchnorm import SyncBatchNorm as Fused

    assert Fused is P.SyncBatchNorm
    import inspect

    sig = inspect.signature(P.DistributedDataParallel.__init__).parameters
    assert sig["message_size"].default == 10000000 and sig["delay_allreduce"].default is False
    assert sig["gradient_predivide_factor"].default == 1.0 and sig["num_allreduce_streams"].default == 1
    sig = inspect.signature(P.SyncBatchNorm.__init__).parameters
    assert [sig[n].default for n in ("eps", "momentum", "affine", "track_running_stats", "process_group",
                                     "channel_last", "fuse_relu")] == [1e-5, 0.1, True, True, None, False, False]


def test_convert_syncbn_model_keeps_state_and_leaves_instance_norm():
    net = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4, momentum=0.3), nn.InstanceNorm2d(4),
                        nn.Sequential(nn.BatchNorm1d(4, eps=1e-3, affine=False)))
    bn = net[1]
    with torch.no_grad():
        bn.weight.uniform_()
        bn.running_mean.uniform_()
    bn.num_batches_tracked += 5
    net.eval()
    out = P.convert_syncbn_model(net, channel_last=True)
    sbn = out[1]
    assert isinstance(sbn, P.SyncBatchNorm) and sbn.channel_last and sbn.momentum == 0.3
    assert sbn.running_mean is bn.running_mean and sbn.running_var is bn.running_var
    assert int(sbn.num_batches_tracked) == 5 and not sbn.training
    assert torch.equal(sbn.weight, bn.weight) and sbn.weight is not bn.weight
    assert type(out[2]) is nn.InstanceNorm2d
    inner = out[3][0]
    assert isinstance(inner, P.SyncBatchNorm) and inner.eps == 1e-3 and inner.weight is None
    top = P.convert_syncbn_model(nn.BatchNorm3d(2))
    assert isinstance(top, P.SyncBatchNorm)


def test_errors_without_a_process_group():
    assert not dist.is_initialized()
    # No group anywhere: plain batch norm.
    x = torch.randn(4, 3, 5)
    assert torch.allclose(P.SyncBatchNorm(3)(x), nn.BatchNorm1d(3)(x), atol=1e-6)
    # A group was asked for but none is initialised: training must say how to fix it; eval works.
    bn = P.SyncBatchNorm(3, process_group=object())
    with pytest.raises(RuntimeError, match="init_process_group"):
        bn(x)
    bn.eval()
    assert bn(x).shape == x.shape
    with pytest.raises(RuntimeError, match="init_process_group"):
        P.create_syncbn_process_group(2)
    assert P.create_syncbn_process_group(0) is None
    with pytest.raises(ValueError, match="group_size"):
        P.create_syncbn_process_group(-1)


@pytest.mark.parametrize("channel_last,fuse_relu", [(False, False), (True, True)])
def test_sync_batchnorm_gradcheck_float64(channel_last, fuse_relu):
    bn = P.SyncBatchNorm(3, channel_last=channel_last, fuse_relu=fuse_relu).double()
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    shape = (4, 5, 3) if channel_last else (4, 3, 5)
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    z = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: bn(a, b), (x, z))
    assert torch.autograd.gradcheck(lambda w, b: P.SyncBatchNorm.forward(bn, x, z), (bn.weight, bn.bias))


def test_sync_batchnorm_output_can_be_modified_in_place():
    # Conv -> BN -> ReLU(inplace=True) is the common pattern; the output must not be a view autograd guards.
    from apex.parallel import SyncBatchNorm

    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), SyncBatchNorm(4), torch.nn.ReLU(inplace=True))
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(inplace=True))
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    ours(x).square().sum().backward()
    grad = x.grad.clone()
    x.grad = None
    ref(x).square().sum().backward()
    assert torch.allclose(grad, x.grad, rtol=1e-5, atol=1e-6)
