"""apex.ops.scaled_masked_softmax: outputs and gradients against a float64 reference on both backends."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.ops import scaled_masked_softmax as S
from apex.testing import TritonTrace, assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NEG = torch.finfo(torch.float64).min / 4


def _masked_scores(x, mask, scale, causal):
    s = x * scale
    masked = torch.zeros(s.shape, dtype=torch.bool)
    if causal:
        masked = masked | torch.ones(s.shape[-2:], dtype=torch.bool).triu(1)
    if mask is not None:
        masked = masked | mask.bool()
    return s, masked


def _ref(x, mask, scale, causal, dy):
    """float64 probabilities and input gradient; rows with every key masked are zeros (Apex's kernels)."""
    x64 = x.detach().double().requires_grad_()
    s, masked = _masked_scores(x64, mask, scale, causal)
    alive = (~masked.all(-1, keepdim=True)).double()
    y = torch.softmax(s.masked_fill(masked, NEG), -1) * alive
    (dx,) = torch.autograd.grad(y, x64, dy.double())
    return y.detach(), dx


def _baseline(x, mask, scale, causal, dy):
    """Plain PyTorch in the input dtype: the error budget for fp16/bf16."""
    xb = x.detach().clone().requires_grad_()
    s, masked = _masked_scores(xb, mask, scale, causal)
    y = torch.softmax(s.masked_fill(masked, -10000.0), -1)
    (dx,) = torch.autograd.grad(y, xb, dy)
    return y.detach(), dx


def _trace(backend_name, *tensors):
    if backend_name != "triton":
        return contextlib.nullcontext(None)
    return TritonTrace(bounds=True).watch(*tensors)


def _check(x, mask, scale, causal, dy, y, dx):
    dtype = x.dtype
    ref_y, ref_dx = _ref(x, mask, scale, causal, dy)
    tol = 1e-6 if dtype == torch.float32 else None
    by, bdx = _baseline(x, mask, scale, causal, dy) if dtype != torch.float32 else (None, None)
    assert y.dtype == dtype and dx.dtype == dtype
    assert_rel_close(y, ref_y, dtype, tol=tol, baseline=by, name="y")
    assert_rel_close(dx, ref_dx, dtype, tol=tol, baseline=bdx, name="dx")


# (b, np, sq, sk, mask shape or None, causal)
CASES = [
    (2, 3, 4, 17, (2, 1, 4, 17), False),
    (1, 2, 3, 1000, (1, 1, 3, 1000), False),   # sq != sk, mask shared by the batch
    (2, 2, 3, 1, (2, 1, 3, 1), False),          # one key: many rows fully masked
    (1, 2, 2, 4097, (1, 1, 2, 4097), False),
    (2, 2, 3, 17, None, False),
    (1, 2, 17, 17, None, True),
    (2, 1, 1, 1, None, True),
    (1, 1, 40, 40, (1, 1, 40, 40), True),       # causal and padding together
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matches_float64(backend_name, case, dtype):
    b, h, sq, sk, mshape, causal = case
    x = (2 * torch.randn(b, h, sq, sk)).to(dtype).requires_grad_()
    mask = torch.rand(mshape) < 0.3 if mshape is not None else None
    dy = torch.randn(b, h, sq, sk).to(dtype)
    with _trace(backend_name, x, mask, dy) as tr:
        y = S.scaled_masked_softmax(x, mask, 0.37, causal=causal)
        (dx,) = torch.autograd.grad(y, x, dy)
    if tr is not None:
        assert tr.launches == 2  # one forward, one backward
    _check(x, mask, 0.37, causal, dy, y, dx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sk,causal,block", [(1000, False, 512), (4097, False, 2048), (130, True, 64)])
def test_rows_longer_than_one_block(sk, causal, block, dtype):
    """The online max/sum path (forced by a small block) agrees with the reference."""
    sq = sk if causal else 3
    b, h = (1, 1) if causal else (2, 1)
    x = (3 * torch.randn(b, h, sq, sk)).to(dtype)
    mask = None if causal else torch.rand(b, 1, sq, sk) < 0.5
    if mask is not None:
        mask[0, 0, 1] = True  # a fully masked row spanning every block
    dy = torch.randn(b, h, sq, sk).to(dtype)
    with apex.backend("triton"), TritonTrace(bounds=True).watch(x, mask, dy) as tr:
        y = S.scaled_masked_softmax_forward(x, mask, 0.5, causal, max_block=block)
        dx = S.scaled_masked_softmax_backward(dy, y, 0.5, causal, max_block=block)
    assert tr.launches == 2
    _check(x, mask, 0.5, causal, dy, y, dx)


def test_fully_masked_rows_give_zeros(backend_name):
    x = torch.randn(3, 2, 4, 9, requires_grad=True)
    mask = torch.zeros(3, 1, 1, 9, dtype=torch.bool)
    mask[1] = True            # a whole batch entry masked (key-padding mask [b, 1, 1, sk])
    mask[2, ..., :4] = True
    y = S.scaled_masked_softmax(x, mask, 1.0)
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert (y[1] == 0).all() and (dx[1] == 0).all()
    assert (y[2, ..., :4] == 0).all()
    torch.testing.assert_close(y[0].sum(-1), torch.ones(2, 4))


@pytest.mark.parametrize("layout", ["heads_transposed", "key_strided"])
def test_non_contiguous(backend_name, layout):
    if layout == "heads_transposed":   # [b, sq, np, sk] storage, as after a matmul on [b, sq, np, d]
        x = torch.randn(2, 5, 3, 33).transpose(1, 2)
        dy = torch.randn(2, 5, 3, 33).transpose(1, 2)
        mask = (torch.rand(2, 5, 3, 33) < 0.3).transpose(1, 2)
    else:                              # every other key
        x = torch.randn(2, 3, 5, 66)[..., ::2]
        dy = torch.randn(2, 3, 10, 33)[:, :, ::2]
        mask = (torch.rand(2, 1, 5, 66) < 0.3)[..., 1::2]
    assert not x.is_contiguous() and not dy.is_contiguous() and not mask.is_contiguous()
    x.requires_grad_()
    with _trace(backend_name, x, mask, dy):
        y = S.scaled_masked_softmax(x, mask, 0.8)
        (dx,) = torch.autograd.grad(y, x, dy)
    assert y.is_contiguous()
    _check(x, mask, 0.8, False, dy, y, dx)


@pytest.mark.parametrize("mshape", [(4, 17), (2, 1, 1, 17), (1, 17), (2, 3, 4, 17)], ids=str)
def test_mask_broadcasts(backend_name, mshape):
    x = torch.randn(2, 3, 4, 17, requires_grad=True)
    mask = torch.rand(mshape) < 0.4
    dy = torch.randn(2, 3, 4, 17)
    y = S.scaled_masked_softmax(x, mask.to(torch.uint8), 1.3)
    (dx,) = torch.autograd.grad(y, x, dy)
    _check(x, mask, 1.3, False, dy, y, dx)


@pytest.mark.parametrize("mdtype", [torch.bool, torch.uint8], ids=str)
def test_mask_layouts_of_one_shape(backend_name, mdtype):
    # The launcher keeps each mask layout's read strides: masks of one shape with other strides (a transposed
    # copy, a slice of a larger one), one after another, each read at its own strides.
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    dy = torch.randn(2, 3, 8, 8)
    base = torch.rand(2, 1, 8, 8) < 0.4
    masks = [base, base.transpose(-1, -2).contiguous().transpose(-1, -2),
             torch.cat([base, ~base], dim=-1)[..., :8], torch.cat([~base, base], dim=-1)[..., 8:]]
    for mask in masks:
        mask = mask.to(mdtype)
        y = S.scaled_masked_softmax(x, mask, 0.7)
        (dx,) = torch.autograd.grad(y, x, dy)
        _check(x, mask, 0.7, False, dy, y, dx)


def test_three_dim_causal_input(backend_name):
    x = torch.randn(6, 9, 9, requires_grad=True)
    dy = torch.randn(6, 9, 9)
    y = S.scaled_masked_softmax(x, None, 0.25, causal=True)
    (dx,) = torch.autograd.grad(y, x, dy)
    assert y.shape == (6, 9, 9)
    _check(x, None, 0.25, True, dy, y, dx)


def test_float64_runs_in_float64(backend_name):
    x = torch.randn(2, 2, 3, 11, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 3, 11) < 0.3
    dy = torch.randn(2, 2, 3, 11, dtype=torch.float64)
    y = S.scaled_masked_softmax(x, mask, 0.5)
    (dx,) = torch.autograd.grad(y, x, dy)
    ref_y, ref_dx = _ref(x, mask, 0.5, False, dy)
    assert_rel_close([y, dx], [ref_y, ref_dx], tol=1e-12)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(b=st.integers(1, 2), h=st.integers(1, 3), sq=st.integers(1, 6), sk=st.integers(1, 70),
       causal=st.booleans(), masked=st.booleans())
def test_random_shapes(backend_name, b, h, sq, sk, causal, masked):
    if causal:
        sq = sk = min(sk, 12)
    x = torch.randn(b, h, sq, sk, requires_grad=True)
    mask = torch.rand(b, 1, sq, sk) < 0.3 if masked else None
    dy = torch.randn(b, h, sq, sk)
    y = S.scaled_masked_softmax(x, mask, 0.9, causal=causal)
    (dx,) = torch.autograd.grad(y, x, dy)
    _check(x, mask, 0.9, causal, dy, y, dx)


def test_causal_kernel_reads_only_the_lower_triangle(triton_device):
    """Forward: reads the lower triangle once, in whole groups of 8 keys up to the diagonal (16-byte vectors,
    in the diagonal's 32-byte sector), and writes every probability once (fp16, one block)."""
    n = 64
    x = torch.randn(1, 2, n, n).half()
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        y = S.scaled_masked_softmax_forward(x, None, 1.0, True)
    tri = sum(min(8 * (q // 8 + 1), n) for q in range(n))
    assert tr.launches == 1
    assert tr.bytes_unique == 2 * (tri + n * n) * 2
    dy = torch.randn_like(y)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        S.scaled_masked_softmax_backward(dy, y, 1.0, True)
    assert tr.launches == 1 and tr.bytes_unique == 2 * (2 * tri + n * n) * 2


def _triu(n):
    return torch.ones(1, 1, n, n, dtype=torch.bool).triu(1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 40, 100, 257])
def test_causal_kernel_matches_its_masked_form_exactly(triton_device, n, dtype):
    """The causal kernel reads only up to each row's diagonal (whole 8-key groups); every row length, with
    anything at all (NaN, inf) above the diagonal, gives exactly what the kernel gives with the upper triangle
    passed as a mask (every key loaded one by one), and the float64 reference's values."""
    dev = triton_device
    if dev.type == "meta":
        pytest.skip("compares computed values")
    x = (3 * torch.randn(2, 2, n, n)).to(dtype)
    x_dirty = x.masked_fill(_triu(n), float("nan"))
    x_dirty[0, 0] = x_dirty[0, 0].masked_fill(_triu(n)[0, 0], float("inf"))
    dy = torch.randn(2, 2, n, n).to(dtype)
    with apex.backend("triton"):
        y = S.scaled_masked_softmax_forward(x_dirty.to(dev), None, 0.37, True)
        y_mask = S.scaled_masked_softmax_forward(x.to(dev), _triu(n).to(dev), 0.37, False)
        dx = S.scaled_masked_softmax_backward(dy.masked_fill(_triu(n), float("nan")).to(dev),
                                              y.masked_fill(_triu(n).to(dev), float("nan")), 0.37, True)
        dx_ref = S.scaled_masked_softmax_backward(dy.to(dev), y, 0.37, False)
    assert torch.equal(y, y_mask)
    assert (y.cpu()[_triu(n).expand(2, 2, n, n)] == 0).all()
    torch.testing.assert_close(y.float().sum(-1).cpu(), torch.ones(2, 2, n), atol=1e-2, rtol=0)
    assert torch.equal(dx, dx_ref)  # (== : a zero's sign aside)
    _check(x, None, 0.37, True, dy, y.cpu(), dx.cpu())


@pytest.mark.parametrize("causal,masked", [(True, False), (False, True), (False, False)])
def test_launch_configurations_give_the_same_probabilities(triton_device, causal, masked):
    """The configuration a sweep or the measured table forces (rows per program, warps) changes only how
    rows share programs: each row's probabilities and gradient are the same (bit for bit where the reduction
    order is the same, under the interpreter; to rounding on a GPU, whose reductions follow the warps)."""
    from apex._kernels import _tuning
    from apex._kernels import scaled_masked_softmax as K

    dev = triton_device
    if dev.type == "meta":
        pytest.skip("compares computed values")
    n = 40
    x = (3 * torch.randn(1, 3, n, n)).to(torch.bfloat16).to(dev)
    dy = torch.randn(1, 3, n, n).to(torch.bfloat16).to(dev)
    mask = (torch.rand(1, 1, n, n) < 0.3).to(dev) if masked else None
    outs = []
    for cfg in ({"rows": 1, "warps": 1}, {"rows": 8, "warps": 2}, {"rows": 64, "warps": 4}):
        with _tuning.override(K.FWD_OP, **cfg), _tuning.override(K.BWD_OP, **cfg):
            y = K.forward(x, mask, 0.5, causal)
            dx = K.backward(dy, y, 0.5, causal, y.dtype)
            assert _tuning.last[K.FWD_OP] == {**_tuning.last[K.FWD_OP], **cfg}
            assert _tuning.last[K.BWD_OP] == {**_tuning.last[K.BWD_OP], **cfg}
        outs.append((y, dx))
    for y, dx in outs[1:]:
        if dev.type == "cpu":
            assert torch.equal(y, outs[0][0]) and torch.equal(dx, outs[0][1])
        else:
            torch.testing.assert_close(y, outs[0][0])
            torch.testing.assert_close(dx, outs[0][1])


def test_padding_kernel_moves_the_minimum(triton_device):
    x = torch.randn(2, 4, 8, 100).half()
    mask = torch.zeros(2, 1, 8, 100, dtype=torch.bool)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        y = S.scaled_masked_softmax_forward(x, mask, 1.0)
    assert tr.launches == 1 and tr.bytes_unique == 2 * x.nbytes + mask.nbytes
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        S.scaled_masked_softmax_backward(torch.randn_like(y), y, 1.0)
    assert tr.launches == 1 and tr.bytes_unique == 3 * x.nbytes


# ---------------------------------------------------------------------------------------- bad input
def test_bad_input_raises_naming_the_argument():
    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(ValueError, match=r"input must be a 4-D"):
        S.scaled_masked_softmax(torch.randn(4, 5), None, 1.0)
    with pytest.raises(ValueError, match=r"mask of shape \[2, 1, 3, 5\] does not broadcast"):
        S.scaled_masked_softmax(x, torch.zeros(2, 1, 3, 5, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match=r"mask of shape"):
        S.scaled_masked_softmax(x, torch.zeros(1, 2, 3, 4, 5, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match=r"sq == sk.*input of shape \[2, 3, 4, 5\]"):
        S.scaled_masked_softmax(x, None, 1.0, causal=True)
    with pytest.raises(TypeError, match=r"mask must be a bool"):
        S.scaled_masked_softmax(x, torch.zeros(2, 1, 4, 5), 1.0)
    with pytest.raises(TypeError, match=r"input must be a floating-point"):
        S.scaled_masked_softmax(torch.ones(2, 3, 4, 5, dtype=torch.long), None, 1.0)
    with pytest.raises(TypeError, match=r"scale must be a real number"):
        S.scaled_masked_softmax(x, None, "2")
    y = S.scaled_masked_softmax_forward(x, None, 1.0)
    with pytest.raises(ValueError, match=r"grad_output has shape"):
        S.scaled_masked_softmax_backward(torch.randn(2, 3, 4, 4), y, 1.0)


@pytest.mark.parametrize("compat", [False, True])
def test_backward_refuses_a_gradient_on_another_device(backend_name, device, compat):
    """The backward entries refuse a gradient on another device than the saved output (``meta`` standing in),
    naming it, before a kernel reads it."""
    import scaled_masked_softmax_cuda

    y = S.scaled_masked_softmax_forward(torch.randn(2, 3, 4, 5, device=device), None, 1.0)
    dy = torch.randn(2, 3, 4, 5, device="meta")
    with pytest.raises(ValueError, match=r"grad_output is on meta"):
        if compat:
            scaled_masked_softmax_cuda.backward(dy, y, 1.0)
        else:
            S.scaled_masked_softmax_backward(dy, y, 1.0)


def test_compat_modules_raise_on_upstream_ranks():
    import scaled_masked_softmax_cuda
    import scaled_upper_triang_masked_softmax_cuda

    with pytest.raises(ValueError, match=r"input must be a 3-D"):
        scaled_upper_triang_masked_softmax_cuda.forward(torch.randn(1, 2, 4, 4), 1.0)
    with pytest.raises(ValueError, match=r"mask must be a 4-D"):
        scaled_masked_softmax_cuda.forward(torch.randn(1, 2, 4, 4), torch.zeros(4, 4, dtype=torch.bool), 1.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_compat_modules_match_reference(backend_name, dtype):
    import generic_scaled_masked_softmax_cuda
    import scaled_masked_softmax_cuda
    import scaled_softmax_cuda
    import scaled_upper_triang_masked_softmax_cuda

    x = torch.randn(2, 3, 6, 6).to(dtype)
    dy = torch.randn(2, 3, 6, 6).to(dtype)
    mask = torch.rand(2, 1, 6, 6) < 0.3
    scale_t = torch.tensor([0.5])
    for mod, m, causal in ((scaled_masked_softmax_cuda, mask, False), (generic_scaled_masked_softmax_cuda, mask,
                                                                        False), (scaled_softmax_cuda, None, False)):
        y = mod.forward(x, m, scale_t[0]) if m is not None else mod.forward(x, scale_t[0])
        dx = mod.backward(dy, y, scale_t[0])
        assert not y.requires_grad
        _check(x, m, 0.5, causal, dy, y, dx)
    y3 = scaled_upper_triang_masked_softmax_cuda.forward(x.view(6, 6, 6), scale_t[0])
    dx3 = scaled_upper_triang_masked_softmax_cuda.backward(dy.view(6, 6, 6), y3, scale_t[0])
    assert y3.shape == (6, 6, 6)
    _check(x, None, 0.5, True, dy, y3.view(2, 3, 6, 6), dx3.view(2, 3, 6, 6))


def test_get_batch_per_block_matches_upstream_formula():
    import scaled_masked_softmax_cuda as ext

    # 128 threads per block; warp = min(next_pow2(sk), 32) lanes; 2 rows per warp up to 128 keys.
    assert ext.get_batch_per_block(24, 24, 4, 12) == 8
    assert ext.get_batch_per_block(4, 214, 32, 12) == 4
    assert ext.get_batch_per_block(16, 16, 1, 1) == 16
    assert ext.get_batch_per_block(1, 1, 1, 1) == 256
    assert ext.get_batch_per_block(1, 16384, 1, 1) == 4


def test_three_dim_input_with_a_three_dim_mask_raises(backend_name):
    # The scores are read as their 4-D view [b*np, 1, sq, sk]: a mask that broadcasts to the 3-D input but not to
    # that view is refused on both paths (read through wrong strides it would give wrong probabilities).
    x = torch.randn(6, 5, 5, requires_grad=True)
    mask = torch.rand(6, 5, 5) < 0.3
    with pytest.raises(RuntimeError):
        S.scaled_masked_softmax(x, mask, 1.0)
    with torch.no_grad(), pytest.raises(RuntimeError):
        S.scaled_masked_softmax(x, mask, 1.0)
