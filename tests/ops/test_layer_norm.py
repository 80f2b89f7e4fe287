"""apex.ops.layer_norm: outputs and gradients against a float64 reference on both backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex._kernels import _tuning
from apex.ops import layer_norm as L
from apex.testing import assert_rel_close
from tests.ops._norms import DTYPES, GRAD_LAYOUTS, SHAPES, grad_like, run, trace


def _params(ns, dtype, affine=True):
    if not affine:
        return None, None
    # Weights away from zero: the memory-efficient backward divides by them.
    w = (1.0 + 0.25 * torch.randn(ns)).to(dtype).requires_grad_()
    b = (0.25 * torch.randn(ns)).to(dtype).requires_grad_()
    return w, b


def _ref(x, ns, w, b, dy, eps):
    """float64 output and gradients."""
    x64 = x.detach().double().requires_grad_()
    leaves = [x64]
    w64 = b64 = None
    if w is not None:
        w64 = w.detach().double().requires_grad_()
        b64 = b.detach().double().requires_grad_()
        leaves += [w64, b64]
    y = F.layer_norm(x64, ns, w64, b64, eps)
    return y, torch.autograd.grad(y, leaves, dy.double())


def _close(outs, refs, dtype=None, *, tol=None, baseline=None, name="output"):
    """assert_rel_close per tensor; a reference that is zero up to rounding (the input gradient of a
    one-element LayerNorm) is checked absolutely, where a relative error means nothing."""
    bases = baseline if baseline is not None else [None] * len(outs)
    for i, (o, r, bl) in enumerate(zip(outs, refs, bases)):
        if r.abs().max() < 1e-9:
            assert o.double().abs().max() < 1e-3, f"{name}[{i}] should be ~0"
        else:
            assert_rel_close(o, r, dtype, tol=tol, baseline=bl, name=f"{name}[{i}]")


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,ns", SHAPES, ids=str)
def test_layer_norm_matches_float64(backend_name, shape, ns, dtype, mem_eff):
    eps = 1e-5
    x = torch.randn(shape).to(dtype).requires_grad_()
    w, b = _params(ns, dtype)
    dy = torch.randn(shape).to(dtype)
    with trace(backend_name, x, w, b, dy) as tr:
        y, grads = run(lambda: L.layer_norm(x, ns, w, b, eps, mem_eff), x, w, dy, b)
    if tr is not None:
        assert tr.launches == 3  # forward, backward, dweight/dbias reduction
    ref_y, ref_g = _ref(x, ns, w, b, dy, eps)
    assert y.dtype == dtype and [g.dtype for g in grads] == [dtype] * 3
    if dtype == torch.float32:
        assert_rel_close(y, ref_y, tol=1e-5, name="y")
        _close(grads, ref_g, tol=1e-5, name="grads")
    else:
        with apex.backend("torch"):
            by, bg = run(lambda: F.layer_norm(x, ns, w, b, eps), x, w, dy, b)
        assert_rel_close(y, ref_y, dtype, baseline=by, name="y")
        _close(grads, ref_g, dtype, baseline=bg, name="grads")


@pytest.mark.parametrize("mem_eff", [False, True])
def test_layer_norm_no_affine(backend_name, mem_eff):
    x = torch.randn(9, 33, requires_grad=True)
    dy = torch.randn(9, 33)
    with trace(backend_name, x, dy) as tr:
        y, (dx,) = run(lambda: L.layer_norm(x, (33,), None, None, 1e-5, mem_eff), x, None, dy)
    if tr is not None:
        assert tr.launches == 2
    ref_y, (ref_dx,) = _ref(x, (33,), None, None, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(dx, ref_dx, tol=1e-5)


@pytest.mark.parametrize("layout", ["row_strided", "transposed"])
def test_layer_norm_non_contiguous(backend_name, layout):
    if layout == "row_strided":
        x = torch.randn(11, 160)[:, 10:110]
    else:
        x = torch.randn(100, 11).t()
    x.requires_grad_()
    w, b = _params((100,), torch.float32)
    dy = torch.randn(22, 100)[::2]  # non-contiguous gradient too
    assert not x.is_contiguous() and not dy.is_contiguous()
    with trace(backend_name, x, w, b, dy):
        y, grads = run(lambda: L.layer_norm(x, (100,), w, b, 1e-5), x, w, dy, b)
    ref_y, ref_g = _ref(x, (100,), w, b, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(list(grads), list(ref_g), tol=1e-5)


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("layout", GRAD_LAYOUTS)
def test_layer_norm_gradient_layouts(backend_name, layout, mem_eff):
    # A 3-D input (saved as is, its rows taken in the backward) and gradients of every layout.
    x = torch.randn(3, 1, 40, requires_grad=True)
    w, b = _params((40,), torch.float32)
    dy = grad_like(layout)
    with trace(backend_name, x, w, b, dy):
        y, grads = run(lambda: L.layer_norm(x, (40,), w, b, 1e-5, mem_eff), x, w, dy, b)
    ref_y, ref_g = _ref(x, (40,), w, b, dy, 1e-5)
    assert grads[0].shape == x.shape
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(list(grads), list(ref_g), tol=1e-5)


def test_layer_norm_mixed_dtypes(backend_name):
    """bf16 input with fp32 parameters: fp32 output (mixed) or bf16 output (plain), fp32 math."""
    x = torch.randn(13, 257).to(torch.bfloat16).requires_grad_()
    w, b = _params((257,), torch.float32)
    dy = torch.randn(13, 257)
    with trace(backend_name, x, w, b, dy):
        y, grads = run(lambda: L.layer_norm(x, (257,), w, b, 1e-5, out_dtype=torch.float32), x, w, dy, b)
    assert y.dtype == torch.float32 and grads[0].dtype == torch.bfloat16 and grads[1].dtype == torch.float32
    ref_y, ref_g = _ref(x, (257,), w, b, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(grads[0], ref_g[0], torch.bfloat16)
    assert_rel_close(list(grads[1:]), list(ref_g[1:]), tol=1e-5)
    plain = L.layer_norm(x.detach(), (257,), w.detach(), b.detach(), 1e-5)
    assert plain.dtype == torch.bfloat16
    assert_rel_close(plain, ref_y, torch.bfloat16)


@pytest.mark.parametrize("shape", [(3, 65536), (1000, 3)], ids=str)
def test_layer_norm_wide_row_and_many_rows(backend_name, shape):
    """Rows of 65,536 elements (the widest one-block row) and more rows than programs."""
    x = torch.randn(shape, requires_grad=True)
    w, b = _params(shape[-1:], torch.float32)
    dy = torch.randn(shape)
    with trace(backend_name, x, w, b, dy):
        y, grads = run(lambda: L.layer_norm(x, shape[-1:], w, b, 1e-5), x, w, dy, b)
    ref_y, ref_g = _ref(x, shape[-1:], w, b, dy, 1e-5)
    assert_rel_close(y, ref_y, tol=1e-5)
    assert_rel_close(list(grads), list(ref_g), tol=1e-5)


def test_layer_norm_backward_is_deterministic(backend_name):
    x = torch.randn(300, 64, requires_grad=True)
    w, b = _params((64,), torch.float32)
    dy = torch.randn(300, 64)
    first = run(lambda: L.layer_norm(x, (64,), w, b), x, w, dy, b)[1]
    second = run(lambda: L.layer_norm(x, (64,), w, b), x, w, dy, b)[1]
    for a, c in zip(first, second):
        assert torch.equal(a, c)


def test_layer_norm_entry_points_match_apex_signatures(backend_name):
    import fused_layer_norm_cuda as ext

    x = torch.randn(5, 2, 12)
    w, b = (t.detach() for t in _params((2, 12), torch.float32))
    dy = torch.randn(5, 2, 12)
    out, mean, invvar = ext.forward_affine(x, [2, 12], w, b, 1e-5)
    assert mean.shape == (5,) and invvar.shape == (5,)
    ref_y, ref_g = _ref(x, (2, 12), w, b, dy, 1e-5)
    assert_rel_close(out, ref_y, tol=1e-5)
    assert_rel_close(mean, x.double().mean((1, 2)), tol=1e-5)
    for mem_eff, saved in [(False, x), (True, out)]:
        gi, gw, gb = ext.backward_affine(dy, None if mem_eff else mean, invvar, saved, [2, 12], w, b, 1e-5,
                                         mem_eff)
        assert_rel_close([gi, gw, gb], list(ref_g), tol=1e-5)
    out2, mean2, invvar2 = ext.forward(x, [2, 12], 1e-5)
    ref_y2, (ref_dx2,) = _ref(x, (2, 12), None, None, dy, 1e-5)
    assert_rel_close(out2, ref_y2, tol=1e-5)
    assert_rel_close(ext.backward(dy, mean2, invvar2, x, [2, 12], 1e-5), ref_dx2, tol=1e-5)
    xh = x.to(torch.bfloat16)
    out3, _, _ = ext.forward_affine_mixed_dtypes(xh, [2, 12], w, b, 1e-5)
    assert out3.dtype == torch.float32
    assert_rel_close(out3, F.layer_norm(xh.double(), (2, 12), w.double(), b.double(), 1e-5), tol=1e-5)


@pytest.mark.parametrize("which", ["grad_output", "mean", "rstd"])
def test_layer_norm_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """fused_layer_norm_cuda's backward refuses a gradient or statistic on another device than the saved input
    (``meta`` standing in), naming it, before a kernel reads it."""
    import fused_layer_norm_cuda as ext

    x = torch.randn(5, 12, device=device)
    w, b = torch.randn(12, device=device), torch.randn(12, device=device)
    _, mean, rstd = ext.forward_affine(x, [12], w, b, 1e-5)
    args = {"grad_output": torch.randn(5, 12, device=device), "mean": mean, "rstd": rstd}
    args[which] = args[which].to("meta")
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        ext.backward_affine(args["grad_output"], args["mean"], args["rstd"], x, [12], w, b, 1e-5, False)


def test_layer_norm_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"\[\*, 7\]"):
        L.layer_norm(x, (7,))
    with pytest.raises(ValueError, match=r"weight must have shape \[8\]"):
        L.layer_norm(x, (8,), torch.ones(7), torch.zeros(8))
    with pytest.raises(ValueError, match=r"bias must have shape \[8\]"):
        L.layer_norm(x, (8,), torch.ones(8), torch.zeros(2, 4))
    with pytest.raises(TypeError, match="floating-point"):
        L.layer_norm(torch.ones(4, 8, dtype=torch.int64), (8,))
    with pytest.raises(TypeError, match="floating-point"):
        L.layer_norm(x, (8,), torch.ones(8, dtype=torch.int32), None)
    with pytest.raises(ValueError, match="at least one dimension"):
        L.layer_norm(x, ())
    with pytest.raises(ValueError, match="is on meta"):
        L.layer_norm(x, (8,), torch.ones(8, device="meta"), None)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 40), n=st.integers(1, 300), affine=st.booleans())
def test_layer_norm_random_shapes(backend_name, rows, n, affine):
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, n, requires_grad=True)
    w, b = _params((n,), torch.float32, affine)
    dy = torch.randn(rows, n)
    with trace(backend_name, x, w, b, dy):
        y, grads = run(lambda: L.layer_norm(x, (n,), w, b, 1e-5), x, w, dy, b)
    ref_y, ref_g = _ref(x, (n,), w, b, dy, 1e-5)
    _close([y], [ref_y], tol=1e-5)
    _close(grads, ref_g, tol=1e-5)


_AOT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from apex._kernels import _norm as K
from apex._kernels import _norm_wide as W

target = GPUTarget("cuda", 90, 32)
fwd = {"X": "*fp32", "R": "*fp32", "H": "*fp32", "Y": "*bf16", "W": "*fp32", "B": "*fp32", "Mean": "*fp32",
       "Rstd": "*fp32", "M": "i32", "N": "i32", "stride_x": "i64", "stride_r": "i64", "eps": "fp32",
       "tiles_per_prog": "i32"}
bwd = {"DY": "*fp16", "V": "*fp16", "W": "*fp32", "B": "*fp32", "Mean": "*fp32", "Rstd": "*fp32", "DR": "*fp16",
       "DX": "*fp16", "DWp": "*fp32", "DBp": "*fp32", "M": "i32", "N": "i32", "stride_dy": "i64",
       "stride_v": "i64", "stride_dr": "i64", "tiles_per_prog": "i32", "eps": "fp32"}
red = {"DWp": "*fp32", "DBp": "*fp32", "DW": "*bf16", "DB": "*bf16", "P": "i32", "N": "i32"}
jobs = []
for rms in (False, True):
    for wtile in (False, True):
        jobs.append((K._fwd_kernel, fwd, dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, HAS_RES=rms, BLOCK_M=4,
                                              BLOCK_N=1024, W_PER_TILE=wtile)))
    for mem_eff in (False, True):
        jobs.append((K._bwd_kernel, bwd, dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, MEM_EFF=mem_eff,
                                              HAS_DR=mem_eff, ONE_DIRECTION=False, BLOCK_M=1, BLOCK_N=8192,
                                              W_PER_TILE=False)))
    # Rows of one element (RMSNorm) or two (LayerNorm): the exact form of dx.
    jobs.append((K._bwd_kernel, bwd, dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, MEM_EFF=False, HAS_DR=False,
                                          ONE_DIRECTION=True, BLOCK_M=16, BLOCK_N=1 if rms else 2,
                                          W_PER_TILE=False)))
    # Wide rows: the weight loaded each pass (with the memory-efficient form, which divides by it).
    jobs.append((K._bwd_kernel, bwd, dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, MEM_EFF=True, HAS_DR=False,
                                          ONE_DIRECTION=False, BLOCK_M=1, BLOCK_N=16384, W_PER_TILE=True)))
jobs.append((K._reduce_kernel, red, dict(HAS_B=True, BLOCK_P=32, BLOCK_N=128)))
# The column-chunked backward of wide rows (_norm_wide): the formula's tiles of 1 x 1024 on 4 warps.
stats = {"DY": "*bf16", "V": "*bf16", "W": "*bf16", "B": "*bf16", "Mean": "*fp32", "Rstd": "*fp32", "C": "*fp32",
         "M": "i32", "N": "i32", "stride_dy": "i64", "stride_v": "i64"}
split = dict(stats, DR="*bf16", DX="*bf16", DWp="*fp32", DBp="*fp32", stride_dr="i64", tiles_per_prog="i32")
for rms in (False, True):
    for mem_eff in (False, True):
        flags = dict(IS_RMS=rms, HAS_W=True, HAS_B=not rms, MEM_EFF=mem_eff, BLOCK_M=1, BLOCK_N=1024)
        jobs.append((W._bwd_stats_kernel, stats, flags))
        jobs.append((W._bwd_split_kernel, split, dict(flags, HAS_DR=mem_eff)))
for fn, sig, consts in jobs:
    sig = dict(sig, **{k: "constexpr" for k in consts})
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
    assert "cubin" in kernel.asm and ".local" not in kernel.asm["ptx"], (fn.__name__, consts)
print("compiled", len(jobs))
"""


def test_kernels_compile_for_an_nvidia_gpu():
    """The interpreter does not run Triton's compiler: build every kernel variant for sm_90 ahead of time
    (no GPU needed), and check the PTX has no local-memory spills."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    out = subprocess.run([sys.executable, "-c", _AOT], capture_output=True, text=True, env=env, cwd=root,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "compiled 21" in out.stdout


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("param_dtype", ["same", torch.float32, None], ids=str)
def test_layer_norm_half_input_statistics_are_fp32(backend_name, dtype, param_dtype):
    # PyTorch's CPU kernel rounds its saved statistics to the half type; ours are fp32 as Apex's (its tests
    # check them to 5e-6), computed from the half input in fp32.
    x = (3.0 + 2.0 * torch.randn(37, 2, 53)).to(dtype)
    ns = (2, 53)
    w, b = _params(ns, dtype if param_dtype == "same" else param_dtype or torch.float32,
                   affine=param_dtype is not None)
    w, b = (t.detach() if t is not None else None for t in (w, b))
    out_dtype = w.dtype if w is not None else dtype
    y, mean, rstd = L.layer_norm_forward(x, ns, w, b, 1e-5, out_dtype)
    assert y.dtype == out_dtype and mean.dtype == rstd.dtype == torch.float32
    x64 = x.double().reshape(37, -1)
    var64, mean64 = torch.var_mean(x64, dim=1, unbiased=False)
    assert_rel_close(mean, mean64, tol=1e-6, name="mean")
    assert_rel_close(rstd, (var64 + 1e-5).rsqrt(), tol=1e-6, name="rstd")
    ref_y, _ = _ref(x, ns, w, b, torch.ones_like(x), 1e-5)
    assert_rel_close(y, ref_y, out_dtype if out_dtype != torch.float32 else dtype, name="y")
    # The backward takes these statistics back and agrees with the float64 gradients.
    dy = torch.randn(x.shape).to(out_dtype)
    _, ref_g = _ref(x, ns, w, b, dy, 1e-5)
    grads = L.layer_norm_backward(dy, mean, rstd, x, ns, w, b)
    assert grads[0].dtype == dtype
    _close([g for g in grads if g is not None], ref_g, dtype, name="grads")


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_triton_layer_norm_rows_of_one_or_two_keep_fp32_accuracy(triton_device, n, mem_eff):
    # Two elements per row: x̂ = ±(h, −h) spans all that is left after the mean is taken out, so dx is the
    # centred w·dy times (1 − mean(x̂²))·rstd, where 1 − mean(x̂²) = eps·rstd² and the general form gets it
    # by cancelling two terms equal to within eps/var. One element: dx is 0. (The PyTorch path is
    # F.layer_norm's own backward.) Row halves-differences in [1, 2]: no row's larger gradient hides another.
    half = (1 + torch.rand(257, 1)) * torch.randn(257, 1).sign()
    x = (torch.randn(257, 1) + torch.cat([half, -half], 1)[:, :n]).requires_grad_()
    w, b = _params((n,), torch.float32)
    dy = torch.randn(257, n)
    with apex.backend("triton"):
        y, grads = run(lambda: L.layer_norm(x, (n,), w, b, 1e-5, mem_eff), x, w, dy, b)
        out, mean, invvar = L.forward_affine(x.detach(), (n,), w.detach(), b.detach(), 1e-5)
        apex_grads = L.backward_affine(dy, mean, invvar, out if mem_eff else x.detach(), (n,), w.detach(),
                                       b.detach(), 1e-5, mem_eff)
    ref_y, ref_g = _ref(x, (n,), w, b, dy, 1e-5)
    _close([y], [ref_y], tol=1e-5, name="y")
    for got in (list(grads), apex_grads):
        if n == 1:
            assert torch.equal(got[0], torch.zeros_like(got[0]))
            _close(got[1:], ref_g[1:], tol=1e-5, name="dweight, dbias")
        else:
            _close(got, ref_g, tol=1e-5, name="grads")


# ------------------------------------------------------------------------ the column-chunked backward (_norm_wide)
# Chunks of 64 columns and tiles of 2 rows: 65 x 200 rows are 4 chunks (the last 8 columns wide) by 33 tiles (the
# last of one row), walked by 17 row groups of 2 tiles (the interpreter stands in 100 SMs: 100 // 4 groups at
# most) but the last, of one.
_WIDE = {"split": 64, "rows": 2, "warps": 1, "programs_per_sm": 1}
_M, _N = 65, 200


@pytest.mark.parametrize("mem_eff", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_layer_norm_wide_backward_matches_float64(triton_device, dtype, mem_eff):
    x = torch.randn(_M, _N).to(dtype).requires_grad_()
    w, b = _params((_N,), dtype)
    dy = torch.randn(_M, _N).to(dtype)
    with apex.backend("triton"):
        with trace("triton", x, w, b, dy) as tr, _tuning.override("layer_norm.bwd", **_WIDE):
            y, grads = run(lambda: L.layer_norm(x, (_N,), w, b, 1e-5, mem_eff), x, w, dy, b)
        one_pass = run(lambda: L.layer_norm(x, (_N,), w, b, 1e-5, mem_eff), x, w, dy, b)[1]
    if tr is not None:  # forward, row statistics, dx and partial sums, their reduction
        assert dict(tr.kernels) == {"_fwd_kernel": 1, "_bwd_stats_kernel": 1, "_bwd_split_kernel": 1,
                                    "_reduce_kernel": 1}, dict(tr.kernels)
    _, ref_g = _ref(x, (_N,), w, b, dy, 1e-5)
    assert [g.dtype for g in grads] == [dtype] * 3
    _close(grads, ref_g, dtype, tol=1e-5 if dtype == torch.float32 else None, name="grads")
    # The one-pass kernel's numerics, its sums in another order: a few output roundings apart at most (one
    # bf16 rounding of one element is ~3e-5 of the norm here).
    _close(grads, [g.double() for g in one_pass], tol=1e-6 if dtype == torch.float32 else 5e-4, name="vs one-pass")


@pytest.mark.parametrize("params,mem_eff", [("weight", True), ("bias", True), ("none", False)])
def test_triton_layer_norm_wide_backward_parameters(triton_device, params, mem_eff):
    """Weight without bias, bias without weight (its partial sums reduced alone), neither."""
    x = torch.randn(_M, _N, requires_grad=True)
    w, b = _params((_N,), torch.float32)
    w, b = (w if params == "weight" else None), (b if params == "bias" else None)
    dy = torch.randn(_M, _N)
    with apex.backend("triton"), trace("triton", x, w, b, dy), _tuning.override("layer_norm.bwd", **_WIDE):
        y, grads = run(lambda: L.layer_norm(x, (_N,), w, b, 1e-5, mem_eff), x, w, dy, b)
    x64 = x.detach().double().requires_grad_()
    p64 = [t.detach().double().requires_grad_() if t is not None else None for t in (w, b)]
    y64 = F.layer_norm(x64, (_N,), *p64, 1e-5)
    ref = torch.autograd.grad(y64, [x64] + [t for t in p64 if t is not None], dy.double())
    assert len(grads) == len(ref)
    assert_rel_close(y, y64, tol=1e-5, name="y")
    assert_rel_close(list(grads), list(ref), tol=1e-5, name="grads")


def test_triton_layer_norm_wide_backward_row_strides_and_determinism(triton_device):
    """Gradient and saved input read at their own row strides (the launcher's rows, not contiguous copies), the
    same bits on a second run."""
    from apex._kernels import _norm as K

    x = torch.randn(_M, _N + 24)[:, 5:5 + _N]
    dy = torch.randn(_M, _N + 40)[:, 17:17 + _N]
    assert x.stride(0) != _N and dy.stride(0) != _N
    w, b = (t.detach() for t in _params((_N,), torch.float32))
    y, mean, rstd, _ = K.forward(x, w, b, 1e-5, torch.float32, False)
    with apex.backend("triton"), _tuning.override("layer_norm.bwd", **_WIDE):
        first = K.backward(dy, x, w, b, mean, rstd, False, False, torch.float32)
        second = K.backward(dy, x, w, b, mean, rstd, False, False, torch.float32)
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    _, ref_g = _ref(x, (_N,), w, b, dy, 1e-5)
    _close(list(first), ref_g, tol=1e-5, name="grads")


def _gpu_formula_with_one_entry(monkeypatch, op, key, config):
    """The launchers' GPU formula (nothing is launched) and a table holding one bf16 entry of ``op``, measured
    on "Measured GPU"."""
    from apex._kernels import _norm as K
    from apex._kernels import _tuned

    monkeypatch.setattr(K, "_INTERP", False)
    monkeypatch.setattr(_tuned, "TABLES", {"Measured GPU": {op: [
        {"itemsize": 2, "key": key, "config": config, "gbps": 1}]}})


def test_layer_norm_backward_takes_the_wide_design_where_one_pass_spills(monkeypatch):
    """The GPU formula: the column-chunked backward for rows wider than 8,192 (16,384 and up: the one-pass
    kernel's sm_90 code spills there; for RMSNorm of 16-bit types from 32,768), the one-pass kernel below. A
    measured entry without "split" (written before the design existed) keeps the one-pass kernel; an override
    takes either."""
    from apex._kernels import _norm as K

    cpu = torch.device("cpu")
    entry = {"rows": 1, "warps": 16, "programs_per_sm": 1}
    _gpu_formula_with_one_entry(monkeypatch, "layer_norm.bwd", [4096, 16384], entry)
    with _tuning.assume_device("Unmeasured GPU", 132):
        assert K._config(4096, 16384, cpu, 2, False, True)["split"] == 1024
        assert K._config(1000, 20000, cpu, 4, False, True)["split"] == 1024
        assert K._config(8192, 8192, cpu, 4, False, True)["split"] == 0
        assert K._config(4096, 16384, cpu, 2, True, True)["split"] == 0
        assert K._config(4096, 16384, cpu, 4, True, True)["split"] == 1024
        assert K._config(2048, 32768, cpu, 2, True, True)["split"] == 1024
        assert "split" not in K._config(4096, 16384, cpu, 2, False, False)
    with _tuning.assume_device("Measured GPU", 132):
        assert K._config(4096, 16384, cpu, 2, False, True) == {**entry, "split": 0}
        with _tuning.override("layer_norm.bwd", split=2048, rows=1, warps=8, programs_per_sm=4):
            assert K._config(4096, 16384, cpu, 2, False, True)["split"] == 2048
        with _tuning.override("layer_norm.bwd"):  # the formula's own choice, as the sweep times it
            assert K._config(4096, 16384, cpu, 2, False, True)["split"] == 1024


# ------------------------------------------------------------------ the forward's parameters: held or per tile
@pytest.mark.parametrize("params", ["both", "weight", "bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_norm_forward_parameters_per_tile_or_held_give_the_same_bits(triton_device, dtype, params):
    """The forward holds weight and bias in registers across its passes (wtile 0) or reads them per tile
    after the row's sums (1, wide rows): the same arithmetic, the same bits, LayerNorm and RMSNorm (with the
    residual add), over tiles of two rows and programs walking several tiles."""
    from apex._kernels import _norm as K

    x, r = torch.randn(_M, _N).to(dtype), torch.randn(_M, _N).to(dtype)
    w, b = (t.detach() for t in _params((_N,), dtype))
    w, b = (w if params in ("both", "weight") else None), (b if params in ("both", "bias") else None)
    for rms in (False, True):
        res = r if rms else None
        outs = []
        for wtile in (0, 1):
            with apex.backend("triton"), _tuning.override(K._op_name(rms, False), rows=2, warps=1,
                                                          programs_per_sm=1, wtile=wtile):
                outs.append(K.forward(x, w, None if rms else b, 1e-5, dtype, rms, res, dtype))
                assert K._PLANS and all(p.w_per_tile == bool(wtile) for p in K._PLANS.values() if not rms
                                        and p.op == "layer_norm.fwd")
        for a, c in zip(*outs):
            assert (a is None and c is None) or torch.equal(a, c)
        h = (x.double() + r.double()).to(dtype).double() if rms else x.double()
        if rms:
            ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * (w.double() if w is not None else 1)
        else:
            ref = F.layer_norm(h, (_N,), *(t.double() if t is not None else None for t in (w, b)), 1e-5)
        _close([outs[1][0]], [ref], dtype, tol=1e-5 if dtype == torch.float32 else None, name="y")


def test_norm_forward_reads_parameters_per_tile_from_32_elements_a_thread(monkeypatch):
    """The GPU formula reads weight and bias per tile where a thread holds 32 elements of a row tile or more
    (every shape of the formula's one-warp-per-1024-columns tiles); a measured entry without "wtile" (timed
    before the choice existed) keeps them held; an override naming it takes either, one that does not takes
    the rule for its own tile."""
    from apex._kernels import _norm as K

    cpu = torch.device("cpu")
    entry = {"rows": 4, "warps": 16, "programs_per_sm": 0}
    _gpu_formula_with_one_entry(monkeypatch, "layer_norm.fwd", [8192, 8192], entry)
    with _tuning.assume_device("Unmeasured GPU", 132):
        for rms in (False, True):
            for m, n in ((8192, 8192), (4096, 16384), (65536, 1024), (1000, 100), (16384, 4096)):
                cfg = K._config(m, n, cpu, 2, rms, False)
                assert cfg["wtile"] == 1, (m, n, cfg)
    with _tuning.assume_device("Measured GPU", 132):
        assert K._config(8192, 8192, cpu, 2, False, False) == {**entry, "wtile": 0}
        with _tuning.override("layer_norm.fwd", rows=1, warps=8, programs_per_sm=0, wtile=1):
            assert K._config(8192, 8192, cpu, 2, False, False)["wtile"] == 1
        with _tuning.override("layer_norm.fwd", rows=1, warps=16, programs_per_sm=0):
            assert K._config(8192, 8192, cpu, 2, False, False)["wtile"] == 0  # 16 elements a thread
