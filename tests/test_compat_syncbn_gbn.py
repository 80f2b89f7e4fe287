"""The ``syncbn``, ``cudnn_gbn_lib`` and ``group_norm_v2_cuda`` compatibility modules against float64
references, called the way Apex's Python code calls them."""

from __future__ import annotations

import cudnn_gbn_lib
import group_norm_v2_cuda
import pytest
import syncbn
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.testing import assert_rel_close, rand

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _bn_ref(x64, w64, b64, eps, z64=None, relu=False, channel_last=False):
    """float64 training-mode batch norm (+ z, relu) of x64 (channel dim 1, or last with channel_last)."""
    xin = x64.movedim(-1, 1) if channel_last else x64
    y = F.batch_norm(xin, None, None, w64, b64, True, 0.0, eps)
    if channel_last:
        y = y.movedim(1, -1)
    if z64 is not None:
        y = y + z64
    return y.relu() if relu else y


def _baseline(x, w, b, eps, channel_last=False):
    """The same batch norm computed by PyTorch in the input dtype (the fp16/bf16 error baseline)."""
    xin = x.movedim(-1, 1) if channel_last else x
    y = F.batch_norm(xin, None, None, w.to(x.dtype), b.to(x.dtype), True, 0.0, eps)
    return y.movedim(1, -1) if channel_last else y


# ----------------------------------------------------------------------------------------------- syncbn
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("channel_last", [False, True])
def test_welford_mean_var(dtype, channel_last):
    x = rand(3, 5, 7, 2, dtype=dtype) * 3 + 1.5
    fn = syncbn.welford_mean_var_c_last if channel_last else syncbn.welford_mean_var
    mean, var = fn(x)
    dims = (0, 1, 2) if channel_last else (0, 2, 3)
    x64 = x.double()
    assert mean.dtype == torch.float32 and var.dtype == torch.float32
    assert_rel_close(mean, x64.mean(dims), torch.float32)
    assert_rel_close(var, x64.var(dims, unbiased=False), torch.float32)


def test_welford_parallel_merges_ranks_of_different_sizes():
    x = rand(9, 6, 4) * 2 + 3
    parts = torch.split(x, [2, 3, 4])
    stats = [syncbn.welford_mean_var(p) for p in parts]
    means = torch.stack([m for m, _ in stats])
    varb = torch.stack([v for _, v in stats])
    counts = torch.tensor([p.numel() // p.shape[1] for p in parts], dtype=torch.int32)
    mean, var, inv_std = syncbn.welford_parallel(means, varb, counts, 1e-5)
    x64 = x.double()
    assert_rel_close(mean, x64.mean((0, 2)), torch.float32)
    assert_rel_close(var, x64.var((0, 2), unbiased=True), torch.float32)
    assert_rel_close(inv_std, torch.rsqrt(x64.var((0, 2), unbiased=False) + 1e-5), torch.float32)
    with pytest.raises(ValueError, match="numel"):
        syncbn.welford_parallel(means, varb, counts[:2], 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_backward_channel_first(dtype, backend_name, device):
    eps = 1e-5
    x = rand(4, 6, 5, 3, dtype=dtype, device=device) + 0.5
    w = rand(6, device=device) + 1
    b = rand(6, device=device)
    dy = rand(*x.shape, dtype=dtype, device=device)
    mean, var = syncbn.welford_mean_var(x)
    inv_std = torch.rsqrt(var + eps)
    y = syncbn.batchnorm_forward(x, mean, inv_std, w.to(dtype) if dtype == torch.float32 else w, b)
    assert y.dtype == dtype and y.shape == x.shape

    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = _bn_ref(x64, w64, b64, eps)
    assert_rel_close(y, ref, dtype, baseline=_baseline(x, w, b, eps))
    ref.backward(dy.double())

    sum_dy, sum_dy_xmu, gw, gb = syncbn.reduce_bn(dy, x, mean, inv_std, w)
    count = torch.tensor([x.numel() // x.shape[1]], dtype=torch.int32)
    dx = syncbn.batchnorm_backward(dy, x, mean, inv_std, w, sum_dy, sum_dy_xmu, count)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert_rel_close(dx, x64.grad, dtype, tol=tol, name="dx")
    assert_rel_close(gw, w64.grad, dtype, tol=tol, name="dw")
    assert_rel_close(gb, b64.grad, dtype, tol=tol, name="db")
    assert gw.dtype == w.dtype

    _, _, gw0, gb0 = syncbn.reduce_bn(dy, x, mean, inv_std, None)
    assert gw0.numel() == 0 and gb0.numel() == 0


@pytest.mark.parametrize("dtype", DTYPES)
def test_channel_last_fused_relu_chain(dtype):
    """Apex's SyncBatchnormFunction with channel_last, z and fuse_relu, on two 'ranks' of one process."""
    eps = 1e-4
    x = rand(5, 3, 7, dtype=dtype) + 0.25
    z = rand(5, 3, 7, dtype=dtype)
    w, b = rand(7) + 1, rand(7)
    dy = rand(5, 3, 7, dtype=dtype)
    halves = [x[:2], x[2:]]
    stats = [syncbn.welford_mean_var_c_last(h) for h in halves]
    counts = torch.tensor([h.numel() // 7 for h in halves], dtype=torch.int32)
    mean, _, inv_std = syncbn.welford_parallel(torch.stack([s[0] for s in stats]),
                                               torch.stack([s[1] for s in stats]), counts, eps)
    y = torch.cat([syncbn.batchnorm_forward_c_last(h, zz, mean, inv_std, w, b, True)
                   for h, zz in ((x[:2], z[:2]), (x[2:], z[2:]))])

    x64, w64, b64, z64 = (t.detach().double().requires_grad_() for t in (x, w, b, z))
    ref = _bn_ref(x64, w64, b64, eps, z64, relu=True, channel_last=True)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert_rel_close(y, ref, dtype, tol=tol)
    ref.backward(dy.double())

    # backward: each rank masks dy, reduces locally; the sums are all-reduced (added) across ranks.
    sl = (slice(0, 2), slice(2, 5))
    g = [syncbn.relu_bw_c_last(dy[s], x[s], z[s], mean, inv_std, w, b) for s in sl]
    red = [syncbn.reduce_bn_c_last(gi, x[s], mean, inv_std, w) for gi, s in zip(g, sl)]
    sum_dy = red[0][0] + red[1][0]
    sum_dy_xmu = red[0][1] + red[1][1]
    dx = torch.cat([syncbn.batchnorm_backward_c_last(gi, x[s], mean, inv_std, w, sum_dy, sum_dy_xmu, counts)
                    for gi, s in zip(g, sl)])
    assert_rel_close(dx, x64.grad, dtype, tol=tol, name="dx")
    assert_rel_close(torch.cat(g), z64.grad, dtype, tol=tol, name="dz")
    assert_rel_close(red[0][2] + red[1][2], w64.grad, dtype, tol=tol, name="dw")
    assert_rel_close(red[0][3] + red[1][3], b64.grad, dtype, tol=tol, name="db")


@settings(max_examples=6, deadline=None)
@given(n=st.integers(2, 5), c=st.integers(1, 9), length=st.integers(2, 11), ranks=st.integers(1, 3),
       affine=st.booleans())
def test_syncbn_chain_ragged_shapes(n, c, length, ranks, affine):
    """Apex's SyncBatchnormFunction (channel-first) split over ``ranks`` pieces of the batch, fp32. (At
    least 4 values per channel: with 2, the input gradient is exactly zero and only rounding remains.)"""
    eps = 1e-5
    x = rand(n * ranks, c, length) * 2 + 1
    dy = rand(n * ranks, c, length)
    w, b = (rand(c) + 1, rand(c)) if affine else (None, None)
    pieces = torch.chunk(x, ranks)
    stats = [syncbn.welford_mean_var(p) for p in pieces]
    counts = torch.tensor([p.numel() // c for p in pieces], dtype=torch.int32)
    mean, _, inv_std = syncbn.welford_parallel(torch.stack([s[0] for s in stats]),
                                               torch.stack([s[1] for s in stats]), counts, eps)
    y = torch.cat([syncbn.batchnorm_forward(p, mean, inv_std, w, b) for p in pieces])
    red = [syncbn.reduce_bn(g, p, mean, inv_std, w) for g, p in zip(torch.chunk(dy, ranks), pieces)]
    sum_dy = sum(r[0] for r in red)
    sum_dy_xmu = sum(r[1] for r in red)
    dx = torch.cat([syncbn.batchnorm_backward(g, p, mean, inv_std, w, sum_dy, sum_dy_xmu, counts)
                    for g, p in zip(torch.chunk(dy, ranks), pieces)])
    x64 = x.double().requires_grad_()
    params = [t.double().requires_grad_() for t in (w, b)] if affine else [None, None]
    ref = _bn_ref(x64, params[0], params[1], eps)
    assert_rel_close(y, ref, torch.float32, tol=1e-5)
    grads = torch.autograd.grad(ref, [x64] + (params if affine else []), dy.double())
    assert_rel_close(dx, grads[0], torch.float32, tol=1e-5, name="dx")
    if affine:
        assert_rel_close(sum(r[2] for r in red), grads[1], torch.float32, tol=1e-5, name="dw")
        assert_rel_close(sum(r[3] for r in red), grads[2], torch.float32, tol=1e-5, name="db")


def test_syncbn_names_match_apex():
    assert set(syncbn.__all__) == {
        "welford_mean_var", "welford_parallel", "batchnorm_forward", "reduce_bn", "batchnorm_backward",
        "welford_mean_var_c_last", "batchnorm_forward_c_last", "reduce_bn_c_last", "batchnorm_backward_c_last",
        "relu_bw_c_last"}


# ------------------------------------------------------------------------------------------- cudnn_gbn_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cudnn_gbn_forward_backward(dtype):
    eps, momentum, C = 1e-5, 0.1, 8
    x = (rand(3, C, 5, 4, dtype=dtype) + 1).contiguous(memory_format=torch.channels_last)
    w, b = rand(C) + 1, rand(C)
    rm, rv = rand(C), rand(C).abs() + 0.5
    rm0, rv0 = rm.clone(), rv.clone()
    mb_mean, mb_inv = torch.empty(C), torch.empty(C)
    y = cudnn_gbn_lib.forward(x, w, b, rm, rv, mb_mean, mb_inv, momentum, eps, 1, 0, [0])
    assert y.is_contiguous(memory_format=torch.channels_last) and y.dtype == dtype

    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = _bn_ref(x64, w64, b64, eps)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3}[dtype]
    assert_rel_close(y, ref, dtype, tol=tol)
    var64 = x64.detach().var((0, 2, 3), unbiased=False)
    assert_rel_close(mb_mean, x64.detach().mean((0, 2, 3)), torch.float32, tol=tol)
    assert_rel_close(mb_inv, torch.rsqrt(var64 + eps), torch.float32, tol=tol)
    assert_rel_close(rm, (1 - momentum) * rm0.double() + momentum * x64.detach().mean((0, 2, 3)), torch.float32,
                     tol=tol)
    assert_rel_close(rv, (1 - momentum) * rv0.double() + momentum * x64.detach().var((0, 2, 3)), torch.float32,
                     tol=tol)

    dy = rand(*x.shape, dtype=dtype)
    ref.backward(dy.double())
    dx, dw, db = cudnn_gbn_lib.backward(x, dy, w, mb_mean, mb_inv, eps, 1, 0, [0])
    assert_rel_close(dx, x64.grad, dtype, tol=tol, name="dx")
    assert_rel_close(dw, w64.grad, dtype, tol=tol, name="dw")
    assert_rel_close(db, b64.grad, dtype, tol=tol, name="db")


def test_cudnn_gbn_group_needs_module():
    x = rand(2, 8, 3, 3)
    c = torch.empty(8)
    with pytest.raises(NotImplementedError, match="GroupBatchNorm2d"):
        cudnn_gbn_lib.forward(x, c + 1, c, c, c, c.clone(), c.clone(), 0.1, 1e-5, 2, 0, [0, 0])
    with pytest.raises(ValueError, match="4-D"):
        cudnn_gbn_lib.forward(x[0], c + 1, c, c, c, c.clone(), c.clone(), 0.1, 1e-5, 1, 0, [0])


# -------------------------------------------------------------------------------------- group_norm_v2_cuda
def _gn_ref(x64, w64, b64, G, eps, silu):
    y = F.group_norm(x64, G, w64, b64, eps)
    return F.silu(y) if silu else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("silu", [False, True])
def test_group_norm_v2(dtype, silu):
    N, C, G, eps = 2, 12, 3, 1e-5
    x = (rand(N, C, 5, 3, dtype=dtype) * 2 + 1).contiguous(memory_format=torch.channels_last)
    w, b = (rand(C) + 1).to(dtype), rand(C).to(dtype)
    mv = torch.empty(2 * N * G)
    y = group_norm_v2_cuda.gn(x, w, b, eps, silu, G, mean_var_out=mv, sm_margin=0)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = _gn_ref(x64, w64, b64, G, eps, silu)
    base = _gn_ref(x, w, b, G, eps, silu)
    assert_rel_close(y, ref, dtype, baseline=base)
    grouped = x64.detach().reshape(N, G, -1)
    pairs = mv.view(N * G, 2)
    assert_rel_close(pairs[:, 0], grouped.mean(-1).reshape(-1), torch.float32, tol=1e-5)
    assert_rel_close(pairs[:, 1], grouped.var(-1, unbiased=False).reshape(-1), torch.float32, tol=1e-5)

    dy = rand(*x.shape, dtype=dtype).contiguous(memory_format=torch.channels_last)
    ref.backward(dy.double())
    dx, dw, db = group_norm_v2_cuda.gn_bwd(dy, x, w, b, mv, eps, silu, G)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert_rel_close(dx, x64.grad, dtype, tol=tol, name="dx")
    assert_rel_close(dw, w64.grad, dtype, tol=tol, name="dw")
    assert_rel_close(db, b64.grad, dtype, tol=tol, name="db")


def test_group_norm_v2_bad_input():
    x = rand(2, 4, 3, 3, dtype=torch.float16)
    w = rand(4, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        group_norm_v2_cuda.gn(x, w, w.float(), 1e-5, False, 2)
    with pytest.raises(ValueError, match="mean_var_out"):
        group_norm_v2_cuda.gn(x, w, w, 1e-5, False, 2, mean_var_out=torch.empty(8, dtype=torch.float16))
