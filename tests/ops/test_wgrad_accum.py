"""apex.ops.wgrad_accum: in-place ``main_grad += grad_outputᵀ @ input`` against float64 on both backends."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.ops import wgrad_accum as W
from apex.testing import TritonTrace, assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _ref(inp, go, mg):
    a = inp.double().reshape(-1, inp.shape[-1])
    g = go.double().reshape(-1, go.shape[-1])
    return mg.double() + g.t() @ a


def _run(fn, inp, go, mg, backend_name):
    ctx = TritonTrace(bounds=True).watch(inp, go, mg) if backend_name == "triton" else contextlib.nullcontext()
    ptr = mg.data_ptr()
    with ctx as tr:
        assert fn(inp, go, mg) is None
    assert mg.data_ptr() == ptr
    if tr is not None:
        assert tr.launches == 1
    return tr


@pytest.mark.parametrize("shape", [((37, 33), 45), ((3, 11, 20), 17), ((1, 1), 1)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_wgrad_fp32_main_grad(backend_name, dtype, shape):
    in_shape, out = shape
    inp = torch.randn(in_shape).to(dtype)
    go = torch.randn(*in_shape[:-1], out).to(dtype)
    mg = torch.randn(out, in_shape[-1])
    ref = _ref(inp, go, mg)
    _run(W.wgrad_gemm_accum_fp32, inp, go, mg, backend_name)
    # The products of fp16/bf16 values are exact in fp32: only fp32 accumulation error remains.
    assert_rel_close(mg, ref, tol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_wgrad_half_main_grad(backend_name, dtype):
    inp = torch.randn(2, 29, 24).to(dtype)
    go = torch.randn(2, 29, 19).to(dtype)
    mg = torch.randn(19, 24).to(dtype)
    ref = _ref(inp, go, mg)
    # PyTorch in that dtype: a half GEMM, then a half add (two roundings).
    base = mg + (go.reshape(-1, 19).t() @ inp.reshape(-1, 24))
    _run(W.wgrad_gemm_accum_fp16, inp, go, mg, backend_name)
    assert_rel_close(mg, ref, dtype, baseline=base)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_wgrad_half_main_grad_from_zero_is_linear_weight_grad_on_cpu(dtype):
    """On the CPU a half main_grad accumulated from zero holds exactly nn.Linear's half weight gradient
    (Megatron's accumulation_in_fp16, which upstream's layer tests compare with an exact tolerance)."""
    g = torch.Generator().manual_seed(3)
    inp = torch.randn(4, 33, 40, generator=g).to(dtype)
    dy = torch.randn(4, 33, 24, generator=g).to(dtype)
    lin = torch.nn.Linear(40, 24, bias=False).to(dtype)
    (lin(inp) * dy).sum().backward()
    mg = torch.zeros(24, 40, dtype=dtype)
    with apex.backend("torch"):
        W.wgrad_gemm_accum_fp16(inp, dy, mg)
    assert torch.equal(mg, lin.weight.grad)


def test_wgrad_non_contiguous_operands_and_main_grad(backend_name):
    inp = torch.randn(24, 3, 40)[:, 1, 5:35]  # strided rows
    go = torch.randn(17, 24).t()  # column-major
    mg_big = torch.randn(17, 50)
    mg = mg_big[:, 10:40]
    ref = _ref(inp, go, mg)
    before = mg_big.clone()
    _run(W.wgrad_gemm_accum_fp32, inp, go, mg, backend_name)
    assert_rel_close(mg, ref, tol=1e-6)
    assert torch.equal(mg_big[:, :10], before[:, :10]) and torch.equal(mg_big[:, 40:], before[:, 40:])


def test_wgrad_accumulates_over_calls(backend_name):
    mg = torch.zeros(7, 9)
    ref = torch.zeros(7, 9, dtype=torch.float64)
    for _ in range(3):
        inp, go = torch.randn(13, 9), torch.randn(13, 7)
        ref = _ref(inp, go, ref)
        W.wgrad_gemm_accum_fp32(inp, go, mg)
    assert_rel_close(mg, ref, tol=1e-6)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(k=st.integers(1, 70), n_in=st.integers(1, 70), n_out=st.integers(1, 70))
def test_wgrad_random_shapes(backend_name, k, n_in, n_out):
    inp, go = torch.randn(k, n_in), torch.randn(k, n_out)
    mg = torch.randn(n_out, n_in)
    ref = _ref(inp, go, mg)
    _run(W.wgrad_gemm_accum_fp32, inp, go, mg, backend_name)
    assert_rel_close(mg, ref, tol=1e-6)


def _bad():
    a, g = torch.randn(5, 4), torch.randn(5, 3)
    return [
        (lambda: W.wgrad_gemm_accum_fp32(a, g, torch.zeros(4, 3)), ValueError, "main_grad must have shape"),
        (lambda: W.wgrad_gemm_accum_fp32(a, g, torch.zeros(3, 4, dtype=torch.float16)), TypeError, "float32"),
        (lambda: W.wgrad_gemm_accum_fp16(a, g, torch.zeros(3, 4)), TypeError, "float16 or bfloat16"),
        (lambda: W.wgrad_gemm_accum_fp32(a, torch.randn(6, 3), torch.zeros(3, 4)), ValueError, "leading dims"),
        (lambda: W.wgrad_gemm_accum_fp32(a, g.half(), torch.zeros(3, 4)), TypeError, "one dtype"),
    ]


@pytest.mark.parametrize("case", range(len(_bad())))
def test_wgrad_bad_input_writes_nothing(backend_name, case):
    call, exc, match = _bad()[case]
    with pytest.raises(exc, match=match):
        call()


def test_wgrad_bad_input_leaves_main_grad_untouched():
    mg = torch.randn(3, 4)
    before = mg.clone()
    with pytest.raises(ValueError):
        W.wgrad_gemm_accum_fp32(torch.randn(5, 4), torch.randn(6, 3), mg)
    assert torch.equal(mg, before)


def test_wgrad_triton_reads_and_writes_main_grad_once(triton_device):
    inp, go = torch.randn(300, 96), torch.randn(300, 80)
    mg = torch.randn(80, 96)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        W.wgrad_gemm_accum_fp32(inp, go, mg)
    # One tile program here; in general each program reads its own A and G panels once.
    minimum = inp.nbytes + go.nbytes + 2 * mg.nbytes
    assert tr.launches == 1 and tr.bytes_unique <= 1.05 * minimum, (tr.bytes_unique, minimum)
