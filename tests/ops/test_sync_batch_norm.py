"""SyncBatchNorm's per-channel kernels (one process: plain batch norm) on the PyTorch and Triton paths.

Each case is checked against a float64 batch norm computed by PyTorch (output, input/z/weight/bias
gradients, running statistics). The Triton path runs under the interpreter with a bounds check and must
take exactly six launches for a forward and backward (statistics partials, finishing, normalise; backward
reduction partials, finishing, backward elementwise) and no per-channel PyTorch operators.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.ops import sync_batch_norm as ops
from apex.parallel import SyncBatchNorm
from apex.testing import TritonTrace, assert_rel_close, to_float64

# (shape as given to the module, channel_last, fuse_relu, with z, dtype); C is 2nd or last dim.
CASES = [
    ((5, 7), False, False, False, torch.float32),            # (N, C)
    ((3, 7, 13), False, False, False, torch.float32),        # (N, C, L), ragged
    ((2, 5, 6, 7), False, True, True, torch.float32),        # (N, C, H, W)
    ((2, 3, 3, 4, 5), False, False, True, torch.float16),    # (N, C, D, H, W)
    ((3, 5, 4, 6), True, True, True, torch.float32),         # channel-last (N, H, W, C)
    ((4, 9, 33), True, False, False, torch.bfloat16),        # channel-last (N, L, C), C = 33
    ((2, 33, 3, 2), False, True, False, torch.bfloat16),     # many channels, relu without z
    ((129, 3), False, True, True, torch.float16),            # long batch, 2-D with z
]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _cf(t, channel_last):
    return t.movedim(-1, 1) if channel_last and t.dim() > 2 else t


def _reference(x, z, gy, w, b, eps, channel_last, fuse_relu):
    x64, z64, gy64 = (to_float64(t) if t is not None else None for t in (x, z, gy))
    x64.requires_grad_()
    w64 = w.detach().double().requires_grad_()
    b64 = b.detach().double().requires_grad_()
    if z64 is not None:
        z64.requires_grad_()
    y = F.batch_norm(_cf(x64, channel_last), None, None, w64, b64, True, 0.0, eps)
    if channel_last and y.dim() > 2:
        y = y.movedim(1, -1)
    if z64 is not None:
        y = y + z64
    if fuse_relu:
        y = F.relu(y)
    (y * gy64).sum().backward()
    return y.detach(), x64.grad, (z64.grad if z64 is not None else None), w64.grad, b64.grad


@pytest.mark.parametrize("shape,channel_last,fuse_relu,with_z,dtype", CASES)
def test_sync_batch_norm_single_process_matches_float64(backend_name, shape, channel_last, fuse_relu, with_z,
                                                       dtype):
    C = shape[-1] if channel_last or len(shape) == 2 else shape[1]
    x = (torch.randn(shape) * 2 + 3).to(dtype).requires_grad_()
    z = torch.randn(shape).to(dtype).requires_grad_() if with_z else None
    gy = torch.randn(shape).to(dtype)
    bn = SyncBatchNorm(C, channel_last=channel_last, fuse_relu=fuse_relu)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    w, b = bn.weight.detach().clone(), bn.bias.detach().clone()
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(x, z, gy)
            y = bn(x, z) if with_z else bn(x)
            y.backward(gy)
        assert dict(tr.kernels) == {"_stats_kernel": 1, "_finish_kernel": 1, "_forward_kernel": 1,
                                    "_backward_reduce_kernel": 1, "_backward_finish_kernel": 1,
                                    "_backward_elemt_kernel": 1}, dict(tr.kernels)
    else:
        y = bn(x, z) if with_z else bn(x)
        y.backward(gy)
    ref_y, ref_dx, ref_dz, ref_dw, ref_db = _reference(x.detach(), z.detach() if with_z else None, gy, w, b,
                                                       bn.eps, channel_last, fuse_relu)
    tol = TOL[dtype]
    assert y.dtype == dtype and y.shape == x.shape
    assert_rel_close(y, ref_y, tol=tol, name="out")
    assert_rel_close(x.grad, ref_dx, tol=4 * tol, name="dx")
    if with_z:
        assert_rel_close(z.grad, ref_dz, tol=tol, name="dz")
    assert_rel_close(bn.weight.grad, ref_dw, tol=4 * tol, name="dweight")
    assert_rel_close(bn.bias.grad, ref_db, tol=tol, name="dbias")
    # Running statistics: unbiased variance, momentum 0.1, from zero/one.
    xc = _cf(x.detach().double(), channel_last).transpose(0, 1).reshape(C, -1)
    assert_rel_close(bn.running_mean, 0.1 * xc.mean(1), tol=1e-6, name="running_mean")
    assert_rel_close(bn.running_var, 0.9 + 0.1 * xc.var(1, unbiased=True), tol=1e-6, name="running_var")


def test_sync_batch_norm_non_contiguous_input(backend_name):
    base = torch.randn(6, 20, 5) * 3 - 1
    x = base[:, ::2, :].transpose(1, 2).transpose(1, 2).requires_grad_()  # (6, 10, 5) with stride 2
    assert not x.is_contiguous()
    bn = SyncBatchNorm(10)
    ref = torch.nn.BatchNorm1d(10)
    ref.load_state_dict(bn.state_dict())
    xr = x.detach().clone().requires_grad_()
    gy = torch.randn(6, 10, 5)
    with TritonTrace(bounds=True) if backend_name == "triton" else _null():
        bn(x).backward(gy)
    ref(xr).backward(gy)
    assert_rel_close(x.grad, xr.grad, tol=1e-5)
    assert_rel_close(bn.running_var, ref.running_var, tol=1e-6)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_stats_accurate_for_large_mean(backend_name):
    # A mean far from zero against a small spread is where naive Σx² - (Σx)² fails in fp32.
    x = (torch.randn(64, 3, 50, dtype=torch.float64) * 0.01 + 1000.0).float()
    with TritonTrace(bounds=True) if backend_name == "triton" else _null():
        mean, var = ops.batch_norm_stats(ops.as_ncl(x, False))
    x64 = x.double()
    assert_rel_close(mean, x64.mean((0, 2)), tol=1e-7)
    assert_rel_close(var, x64.var((0, 2), unbiased=False), tol=1e-3)


def test_momentum_none_is_cumulative_and_eval_falls_back(backend_name):
    bn = SyncBatchNorm(4, momentum=None)
    ref = torch.nn.BatchNorm2d(4, momentum=None)
    for i in range(3):
        x = torch.randn(3, 4, 5, 2) * (i + 1) + i
        bn(x)
        ref(x)
    assert_rel_close(bn.running_mean, ref.running_mean, tol=1e-6)
    assert_rel_close(bn.running_var, ref.running_var, tol=1e-6)
    bn.eval()
    ref.eval()
    x = torch.randn(2, 4, 3, 3)
    assert_rel_close(bn(x), ref(x), tol=1e-6)
    # Without running statistics, eval mode also normalises with the batch statistics.
    bn2 = SyncBatchNorm(4, track_running_stats=False).eval()
    ref2 = torch.nn.BatchNorm2d(4, track_running_stats=False).eval()
    assert_rel_close(bn2(x), ref2(x), tol=1e-6)
    # Channel-last eval with z and relu uses the running statistics as well.
    bn3 = copy.deepcopy(bn)
    bn3.channel_last, bn3.fuse_relu = True, True
    xl, zl = x.movedim(1, -1), torch.randn(2, 3, 3, 4)
    assert_rel_close(bn3(xl, zl), F.relu(ref(x).movedim(1, -1) + zl), tol=1e-6)


def test_bad_inputs():
    bn = SyncBatchNorm(4)
    with pytest.raises(ValueError, match="more than 1 value"):
        bn(torch.randn(1, 4))
    with pytest.raises(ValueError, match="channels"):
        bn(torch.randn(3, 5))
    with pytest.raises(ValueError, match="z"):
        bn(torch.randn(3, 4), torch.randn(3, 5))
    with pytest.raises(TypeError, match="float32"):
        ops.as_ncl(torch.ones(3, 4, dtype=torch.int64), False)
    with apex.backend("torch"):
        assert bn(torch.randn(3, 4)).shape == (3, 4)


@pytest.mark.no_triton_launch("refused before any launch")
@pytest.mark.parametrize("case", ["weight", "running_mean", "z", "eval", "elemt_z", "backward_reduce_dy"])
def test_triton_path_refuses_tensors_on_another_device(triton_device, case):
    """The Triton kernels read the parameters, running statistics, z and the backward's tensors next to the
    input: one on another device (``meta`` standing in) is refused, naming it, before a kernel reads it; the
    running statistics keep their values."""
    x = torch.randn(6, 4, 3, device=triton_device)
    bn = SyncBatchNorm(4).to(triton_device)
    z = None
    match = {"elemt_z": "z", "backward_reduce_dy": "dy"}.get(case, case)
    if case in ("weight", "running_mean"):
        setattr(bn, case, getattr(bn, case).to("meta") if case == "running_mean"
                else torch.nn.Parameter(bn.weight.detach().to("meta")))
    elif case == "z":
        z = torch.randn(6, 4, 3, device="meta")
    elif case == "eval":
        bn = SyncBatchNorm(4, fuse_relu=True).to("meta").eval()  # (the fused path: no F.batch_norm fallback)
        match = "weight"
    before = bn.running_var.clone() if case != "eval" else None
    with apex.backend("triton"), pytest.raises(ValueError, match=f"{match}.* is on meta"):
        if case == "elemt_z":
            mean, var = ops.batch_norm_stats(x)
            ops.batch_norm_elemt(x, mean, var.add(1e-5).rsqrt(), None, None, torch.randn(6, 4, 3, device="meta"))
        elif case == "backward_reduce_dy":
            mean, var = ops.batch_norm_stats(x)
            ops.batch_norm_backward_reduce(torch.randn(6, 4, 3, device="meta"), x, mean, var.add(1e-5).rsqrt(),
                                           None, None)
        else:
            bn(x, z)
    if before is not None:
        assert torch.equal(bn.running_var, before)


def test_function_refuses_z_on_another_device_before_any_update(backend_name, device):
    """``SyncBatchnormFunction.apply`` called directly (as Apex's code may) with ``z`` on another device
    (``meta`` standing in): refused naming it, on both paths, before the running statistics change."""
    from apex.parallel.sync_batchnorm import SyncBatchnormFunction

    x, w, b = torch.randn(6, 4, 3, device=device), torch.ones(4, device=device), torch.zeros(4, device=device)
    rm, rv = torch.zeros(4, device=device), torch.ones(4, device=device)
    z = torch.randn(6, 4, 3, device="meta")
    with pytest.raises(ValueError, match="z is on meta"):
        SyncBatchnormFunction.apply(x, z, w, b, rm, rv, 1e-5, True, 0.1, None, False, False, False)
    assert torch.equal(rm, torch.zeros_like(rm)) and torch.equal(rv, torch.ones_like(rv))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 6), c=st.integers(1, 40), l_=st.integers(1, 30), channel_last=st.booleans(),
       loc=st.floats(-50, 50), spread=st.floats(0.1, 10))
def test_stats_and_gradients_random_shapes(backend_name, n, c, l_, channel_last, loc, spread):
    shape = (n, l_, c) if channel_last else (n, c, l_)
    if n * l_ < 4:
        return  # with 2-3 values per channel dx is pure cancellation (exactly 0 for 2 when eps -> 0)
    x = (torch.randn(shape) * spread + loc).requires_grad_()
    gy = torch.randn(shape)
    bn = SyncBatchNorm(c, channel_last=channel_last)
    with TritonTrace(bounds=True) if backend_name == "triton" else _null():
        y = bn(x)
        y.backward(gy)
    ref_y, ref_dx, _, ref_dw, ref_db = _reference(x.detach(), None, gy, bn.weight.detach(), bn.bias.detach(),
                                                  bn.eps, channel_last, False)
    # fp32 conditioning grows with |loc| / spread: PyTorch's own fp32 batch norm is the baseline.
    xb = x.detach().clone().requires_grad_()
    wb = bn.weight.detach().clone().requires_grad_()
    bb = bn.bias.detach().clone().requires_grad_()
    yb = F.batch_norm(_cf(xb, channel_last), None, None, wb, bb, True, 0.0, bn.eps)
    yb = yb.movedim(1, -1) if channel_last else yb
    yb.backward(gy)
    assert_rel_close(y, ref_y, tol=1e-5, baseline=yb.detach(), name="out")
    assert_rel_close(x.grad, ref_dx, tol=1e-4, baseline=xb.grad, name="dx")
    assert_rel_close(bn.weight.grad, ref_dw, tol=1e-4, baseline=wb.grad, name="dweight")
    assert_rel_close(bn.bias.grad, ref_db, tol=1e-5, baseline=bb.grad, name="dbias")


def test_triton_path_runs_no_per_channel_operators(backend_name):
    # Statistics, running-statistics update, scale/shift, grad_weight/grad_bias and the means of the
    # backward are finished in kernels, the module's num_batches_tracked += 1 too: a training step issues no
    # PyTorch operator of its own (eval: none either). With momentum=None the factor needs the new count on
    # the host: that step's one operator is the increment.
    from apex._backend import interpreting
    from apex.testing import count_eager

    if backend_name != "triton":
        pytest.skip("the PyTorch path is PyTorch operators by design")
    bn = SyncBatchNorm(6, fuse_relu=True)
    x = (torch.randn(3, 6, 4, 5) + 1).requires_grad_()
    z = torch.randn(3, 6, 4, 5).requires_grad_()
    gy = torch.randn(3, 6, 4, 5)

    def step():
        bn(x, z).backward(gy)
        x.grad = z.grad = bn.weight.grad = bn.bias.grad = None  # no accumulation into .grad

    def own(counts):
        ops_ = dict(counts["ops"])
        if interpreting():
            ops_.pop("copy_", None)  # the interpreter's transfers between tensors and its numpy arrays
        return ops_

    tracked = bn.num_batches_tracked
    assert own(count_eager(step)) == {}
    assert bn.num_batches_tracked is tracked and int(tracked) == 1
    with torch.no_grad():  # the Function-free path
        assert own(count_eager(lambda: bn(x, z))) == {}
    assert int(tracked) == 2
    bn.momentum = None
    assert own(count_eager(step)) == {"add_": 1}
    assert int(tracked) == 3
    bn.eval()
    assert own(count_eager(step)) == {}
    assert int(tracked) == 3


@pytest.mark.parametrize("kind", ["half_module", "no_affine", "no_running_stats", "momentum_zero"])
def test_triton_finishing_variants_match_float64(backend_name, kind):
    # The finishing kernel's branches: fp16 weight/bias and running statistics (a module in half), no
    # weight or bias, no running statistics (batch statistics in eval too), momentum 0 (no update).
    C = 5
    x = (torch.randn(4, C, 6) * 3 + 2).half() if kind == "half_module" else torch.randn(4, C, 6) * 3 + 2
    x.requires_grad_()
    gy = torch.randn(4, C, 6).to(x.dtype)
    bn = SyncBatchNorm(C, affine=kind != "no_affine", track_running_stats=kind != "no_running_stats",
                       momentum=0.0 if kind == "momentum_zero" else 0.1)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    if kind == "half_module":
        bn.half()
    with TritonTrace(bounds=True) if backend_name == "triton" else _null():
        y = bn(x)
        y.backward(gy)
    x64 = x.detach().double().requires_grad_()
    w64 = bn.weight.detach().double().requires_grad_() if bn.affine else None
    b64 = bn.bias.detach().double().requires_grad_() if bn.affine else None
    ref = F.batch_norm(x64, None, None, w64, b64, True, 0.0, bn.eps)
    ref.backward(gy.double())
    tol = 2e-3 if kind == "half_module" else 1e-5
    assert_rel_close(y, ref, tol=tol, name="out")
    assert_rel_close(x.grad, x64.grad, tol=4 * tol, name="dx")
    if bn.affine:
        assert_rel_close(bn.weight.grad, w64.grad, tol=4 * tol, name="dweight")
        assert_rel_close(bn.bias.grad, b64.grad, tol=tol, name="dbias")
    xc = x.detach().double().transpose(0, 1).reshape(C, -1)
    if kind == "no_running_stats":
        assert bn.running_mean is None
        bn.eval()  # batch statistics in eval mode too
        assert_rel_close(bn(x.detach()), ref.detach(), tol=tol, name="eval out")
    elif kind == "momentum_zero":
        assert torch.equal(bn.running_mean, torch.zeros(C)) and torch.equal(bn.running_var, torch.ones(C))
    else:
        assert bn.running_mean.dtype == x.dtype  # updated in its own dtype (fp16 for a module in half)
        assert_rel_close(bn.running_mean, 0.1 * xc.mean(1), tol=tol / 2, name="running_mean")
        assert_rel_close(bn.running_var, 0.9 + 0.1 * xc.var(1, unbiased=True), tol=tol / 2, name="running_var")


@pytest.mark.parametrize("channel_last", [False, True])
def test_results_are_deterministic_run_to_run(backend_name, channel_last):
    # The partial rows are summed in a fixed order (no atomics): bit-for-bit equal outputs, gradients and
    # running statistics from two identical modules.
    shape = (8, 7, 6, 33) if channel_last else (8, 33, 7, 6)
    x = torch.randn(shape) * 2 + 1
    gy = torch.randn(shape)
    results = []
    for _ in range(2):
        bn = SyncBatchNorm(33, channel_last=channel_last)
        xi = x.clone().requires_grad_()
        y = bn(xi)
        y.backward(gy)
        results.append((y, xi.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_triton_path_without_gradient_records_nothing(backend_name, monkeypatch):
    """Under no_grad a training step of the Triton path runs its kernels without the autograd Function (no
    context, nothing saved): the same output and running statistics as a step that records a graph."""
    import apex.parallel.sync_batchnorm as sbn

    if backend_name != "triton":
        pytest.skip("the PyTorch path without a process group is PyTorch's batch norm")
    bn = SyncBatchNorm(6, fuse_relu=True)
    twin = copy.deepcopy(bn)
    x, z = torch.randn(3, 6, 4, 5) + 1, torch.randn(3, 6, 4, 5)
    ref = bn(x, z)

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(sbn.SyncBatchnormFunction, "forward", staticmethod(refuse))
    with torch.no_grad():
        y = twin(x, z)
    assert y.grad_fn is None and torch.equal(y, ref.detach())
    assert torch.equal(twin.running_mean, bn.running_mean) and torch.equal(twin.running_var, bn.running_var)
