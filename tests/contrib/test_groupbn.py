"""apex.contrib.groupbn.BatchNorm2d_NHWC and apex.contrib.cudnn_gbn.GroupBatchNorm2d: one process against
float64 batch norm, and 2 Gloo ranks against the same computation on the concatenated batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from apex.contrib.cudnn_gbn import GroupBatchNorm2d
from apex.contrib.groupbn import BatchNorm2d_NHWC
from apex.testing import assert_rel_close, run_distributed

C = 8


def _ref_nhwc(x, w, b, z=None, relu=False):
    y = F.batch_norm(x.double().permute(0, 3, 1, 2), None, None, w.double(), b.double(), True, 0.0, 1e-5)
    y = y.permute(0, 2, 3, 1)
    if z is not None:
        y = y + z.double()
    return torch.relu(y) if relu else y


@pytest.mark.parametrize("fuse_relu,with_z", [(False, False), (True, False), (True, True)])
def test_nhwc_single_process(fuse_relu, with_z):
    bn = BatchNorm2d_NHWC(C, fuse_relu=fuse_relu)
    with torch.no_grad():
        bn.weight.add_(torch.randn(C) * 0.1)
        bn.bias.add_(torch.randn(C) * 0.1)
    x = torch.randn(3, 5, 4, C, requires_grad=True)
    z = torch.randn(3, 5, 4, C, requires_grad=True) if with_z else None
    y = bn(x, z)
    dy = torch.randn_like(y)
    wrt = [x, bn.weight, bn.bias] + ([z] if with_z else [])
    grads = torch.autograd.grad(y, wrt, dy)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, bn.weight, bn.bias))
    z64 = z.detach().double().requires_grad_() if with_z else None
    ref = _ref_nhwc(x64, w64, b64, z64, fuse_relu)
    ref_grads = torch.autograd.grad(ref, [x64, w64, b64] + ([z64] if with_z else []), dy.double())
    assert_rel_close(y, ref, tol=1e-5)
    assert_rel_close(list(grads), list(ref_grads), tol=1e-5)
    # running statistics: unbiased variance, momentum 0.1
    xs = x.detach().double().reshape(-1, C)
    assert_rel_close(bn.running_mean, 0.1 * xs.mean(0), tol=1e-5)
    assert_rel_close(bn.running_var, 0.9 + 0.1 * xs.var(0), tol=1e-5)


def test_group_batch_norm_single_process_and_eval():
    bn = GroupBatchNorm2d(C, 1)
    x = torch.randn(4, C, 3, 5).to(memory_format=torch.channels_last)
    y = bn(x)
    ref = F.batch_norm(x.double(), None, None, bn.weight.double(), bn.bias.double(), True, 0.0, 1e-5)
    assert_rel_close(y, ref, tol=1e-5)
    bn.eval()
    assert_rel_close(bn(x), F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, False), tol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="multiple of 8"):
        GroupBatchNorm2d(6, 1)(torch.randn(2, 6, 3, 3))
    with pytest.raises(ValueError, match="fuse_relu"):
        BatchNorm2d_NHWC(C)(torch.randn(2, 3, 3, C), torch.randn(2, 3, 3, C))
    with pytest.raises(ValueError, match="N, H, W, C"):
        BatchNorm2d_NHWC(C)(torch.randn(2, 3, C))
    with pytest.raises(RuntimeError, match="init_process_group"):
        GroupBatchNorm2d(C, 2)


def _worker(rank, world, kind):
    torch.manual_seed(0)
    full = torch.randn(2 * 3, 4, 5, C, dtype=torch.float64)  # the same on every rank
    dy_full = torch.randn_like(full)
    mine = full[3 * rank:3 * rank + 3].float().requires_grad_()
    if kind == "nhwc":
        bn = BatchNorm2d_NHWC(C, bn_group=2)
        y = bn(mine)
    else:
        bn = GroupBatchNorm2d(C, 2)
        y = bn(mine.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    dx, dw, db = torch.autograd.grad(y, (mine, bn.weight, bn.bias), dy_full[3 * rank:3 * rank + 3].float())
    x64 = full.clone().requires_grad_()
    w64, b64 = torch.ones(C, dtype=torch.float64, requires_grad=True), torch.zeros(C, dtype=torch.float64,
                                                                                   requires_grad=True)
    ref = _ref_nhwc(x64, w64, b64)
    rdx, rdw, rdb = torch.autograd.grad(ref, (x64, w64, b64), dy_full)
    assert_rel_close(y, ref[3 * rank:3 * rank + 3], tol=1e-5)
    assert_rel_close(dx, rdx[3 * rank:3 * rank + 3], tol=1e-5)
    if kind == "cudnn_gbn":  # Apex's cuDNN GBN: the group's weight/bias gradient over the group size
        assert_rel_close([dw, db], [rdw / 2, rdb / 2], tol=1e-5)
    assert_rel_close(bn.running_mean, 0.1 * full.reshape(-1, C).mean(0), tol=1e-5)


@pytest.mark.parametrize("kind", ["nhwc", "cudnn_gbn"])
def test_two_gloo_ranks_match_one_process(kind):
    run_distributed(_worker, 2, kind, timeout_s=60.0)
