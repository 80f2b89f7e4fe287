"""SyncBatchNorm on 2 and 3 Gloo ranks against nn.BatchNorm over the concatenated batch.

Per-rank batch sizes differ (rank r holds 2 + r samples), so the parallel Welford merge must weight each
rank by its count. The loss is ``Σ y * g`` with a fixed random ``g``: each rank's input gradient must equal
its slice of the reference input gradient, and the sum over ranks of the local weight/bias gradients must
equal the reference's. The same cases run on the Triton path on 2 ranks (interpreted on the CPU, compiled
under ``APEX_TEST_DEVICE=cuda``): per-rank statistics finished to one fp64 row in a kernel, all-gathered, and
merged, with the running statistics, in another.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import apex
import apex.parallel as P
from apex.testing import rel_error, run_distributed

C = 3
CASES = [
    # (spatial shape, channel_last, fuse_relu, with z, momentum)
    ((), False, False, False, 0.1),          # (N, C): 1-D batch norm on vectors
    ((7,), False, False, False, None),       # (N, C, L): cumulative running average
    ((4, 5), False, True, True, 0.1),        # (N, C, H, W) with residual and relu
    ((3, 2, 4), False, False, True, 0.3),    # (N, C, D, H, W)
    ((4, 5), True, True, True, 0.1),         # channel-last (N, H, W, C) with residual and relu
    ((6,), True, False, False, None),        # channel-last (N, L, C)
]
BN = {0: nn.BatchNorm1d, 1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _sizes(world):
    return [2 + r for r in range(world)]


def _to_channel_first(t, channel_last):
    return t.movedim(-1, 1) if channel_last and t.dim() > 2 else t


def _check(name, out, ref, tol=2e-6):
    err = rel_error(out, ref)
    assert err <= tol, f"{name}: rel err {err:.2e}"


def _case(rank, world, spatial, channel_last, fuse_relu, with_z, momentum, seed):
    sizes = _sizes(world)
    g = torch.Generator().manual_seed(seed)
    shape_cf = (sum(sizes), C, *spatial)
    x_all = torch.randn(shape_cf, generator=g, dtype=torch.float64).float() * 3 + 1.5
    z_all = torch.randn(shape_cf, generator=g) if with_z else None
    gy_all = torch.randn(shape_cf, generator=g)
    w = torch.rand(C, generator=g) + 0.5
    b = torch.randn(C, generator=g)

    ref = BN[len(spatial)](C, momentum=momentum)
    ref.weight.data.copy_(w)
    ref.bias.data.copy_(b)
    sbn = P.SyncBatchNorm(C, momentum=momentum, channel_last=channel_last, fuse_relu=fuse_relu)
    sbn.load_state_dict(ref.state_dict())

    lo = sum(sizes[:rank])
    sl = slice(lo, lo + sizes[rank])
    layout = (lambda t: t.movedim(1, -1).contiguous()) if channel_last and spatial else (lambda t: t)
    for step in range(2):
        xr = ((x_all + step)[sl]).clone()
        x_in = layout(xr).requires_grad_()
        z_in = layout(z_all[sl]).requires_grad_() if with_z else None
        out = sbn(x_in, z_in) if with_z else sbn(x_in)
        (out * layout(gy_all[sl])).sum().backward()

        x_ref = (x_all + step).clone().requires_grad_()
        z_ref = z_all.clone().requires_grad_() if with_z else None
        y = ref(x_ref)
        if with_z:
            y = y + z_ref
        if fuse_relu:
            y = F.relu(y)
        (y * gy_all).sum().backward()

        what = f"{name_of(spatial, channel_last, fuse_relu, with_z)} step {step}"
        _check(f"{what} out", _to_channel_first(out.detach(), channel_last), y.detach()[sl])
        _check(f"{what} dx", _to_channel_first(x_in.grad, channel_last), x_ref.grad[sl])
        if with_z:
            _check(f"{what} dz", _to_channel_first(z_in.grad, channel_last), z_ref.grad[sl])
        gw, gb = sbn.weight.grad.clone(), sbn.bias.grad.clone()
        dist.all_reduce(gw)
        dist.all_reduce(gb)
        _check(f"{what} dweight", gw, ref.weight.grad)
        _check(f"{what} dbias", gb, ref.bias.grad)
        _check(f"{what} running_mean", sbn.running_mean, ref.running_mean)
        _check(f"{what} running_var", sbn.running_var, ref.running_var)
        sbn.zero_grad()
        ref.zero_grad()
    assert int(sbn.num_batches_tracked) == 2
    # Eval: plain batch norm with the (synchronised) running statistics.
    sbn.eval()
    ref.eval()
    xe = x_all[sl]
    ye = ref(xe)
    if with_z:
        ye = ye + z_all[sl]
    if fuse_relu:
        ye = F.relu(ye)
    oe = sbn(layout(xe), layout(z_all[sl])) if with_z else sbn(layout(xe))
    _check("eval", _to_channel_first(oe.detach(), channel_last), ye.detach())


def name_of(spatial, channel_last, fuse_relu, with_z):
    return f"{len(spatial) + 2}-D cl={channel_last} relu={fuse_relu} z={with_z}"


def _syncbn_worker(rank, world):
    for i, case in enumerate(CASES):
        _case(rank, world, *case, seed=100 + i)

    # A group per rank (group_size=1): statistics are local.
    if world == 2:
        group = P.create_syncbn_process_group(1)
        sbn = P.SyncBatchNorm(C, process_group=group)
        x = torch.randn(3 + rank, C, 5)
        _check("group of one", sbn(x).detach(), F.batch_norm(x, None, None, training=True))
        assert P.create_syncbn_process_group(0) is None
    else:
        with pytest.raises(ValueError, match="divide"):
            P.create_syncbn_process_group(2)

    # convert_syncbn_model + DDP: gradients equal one process with BatchNorm over the whole batch.
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 5 * 5, 3))
    ref = copy.deepcopy(net)
    model = P.DistributedDataParallel(P.convert_syncbn_model(copy.deepcopy(net)), message_size=50)
    assert isinstance(model.module[1], P.SyncBatchNorm)
    sizes = [4] * world
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(sizes), 2, 5, 5, generator=g)
    t = torch.randn(sum(sizes), 3, generator=g)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        sl = slice(4 * rank, 4 * rank + 4)
        ((model(x[sl] + step) - t[sl]) ** 2).mean().backward()
        ((ref(x + step) - t) ** 2).mean().backward()
        for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
            _check(f"ddp+syncbn {n}", p.grad, q.grad, tol=1e-5)
        _check("ddp+syncbn running_var", model.module[1].running_var, ref[1].running_var)


@pytest.mark.parametrize("world", [2, 3])
def test_sync_batchnorm_matches_batchnorm_over_the_concatenated_batch(world, dist_device):
    # on a GPU: SyncBatchNorm's Triton kernels against cuDNN's batch norm, statistics exchanged by Gloo
    run_distributed(_syncbn_worker, world, device=dist_device)


def _triton_worker(rank, world):
    with apex.backend("triton"):
        for i, case in enumerate(CASES):
            _case(rank, world, *case, seed=200 + i)
        # A rank with an empty batch merges its zero-count row through the PyTorch operators, the other
        # through the kernels: the collectives must still pair up and agree.
        sbn = P.SyncBatchNorm(C)
        x = torch.randn(0 if rank == 0 else 6, C, 4).requires_grad_()
        y = sbn(x)
        y.sum().backward()
        if rank == 1:
            _check("empty rank 0", y.detach(), F.batch_norm(x.detach(), None, None, training=True))


def test_sync_batchnorm_triton_path_on_two_ranks(dist_device):
    run_distributed(_triton_worker, 2, device=dist_device, timeout_s=120.0)
