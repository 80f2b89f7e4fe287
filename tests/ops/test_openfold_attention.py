"""apex.contrib.openfold_triton attention (AttnTri, AttnBiasJIT, AttnNoBiasJIT; apex.ops.openfold_attention) against
float64 references on both backends (the Triton path under the interpreter), and the MHA switch."""

from __future__ import annotations

import math

import pytest
import torch

from apex.contrib.openfold_triton import (
    AttnBiasJIT,
    AttnNoBiasJIT,
    AttnTri,
    CanSchTriMHA,
    mha,
)
from apex.testing import assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------------------------ attention
def _attn_eager(q, k, v, mask, bias, inf):
    """Upstream's reference formula, in whatever dtype the inputs have."""
    a = torch.matmul(q * (1.0 / math.sqrt(q.size(-1))), k.transpose(-1, -2))
    if mask is not None:
        a = a + (mask - 1.0) * inf
    if bias is not None:
        a = a + bias
    return torch.matmul(torch.softmax(a, dim=-1), v)


def _attn_inputs(lead, h, nq, nk, d, dtype, bias=True):
    q = torch.randn(*lead, h, nq, d).to(dtype).requires_grad_()
    k = torch.randn(*lead, h, nk, d).to(dtype).requires_grad_()
    v = torch.randn(*lead, h, nk, d).to(dtype).requires_grad_()
    mask = (torch.rand(*lead[:-1], lead[-1], 1, 1, nk) > 0.3)
    mask[..., 0] = True  # no fully masked row
    mask = mask.to(dtype)
    b = torch.randn(*([1] * len(lead)), h, nq, nk).to(dtype).requires_grad_() if bias else None
    return q, k, v, mask, b


def _check_attn(out_fn, q, k, v, mask, b, dtype, inf=1e9):
    leaves = [t for t in (q, k, v, b) if t is not None]
    o = out_fn(q, k, v, mask, b, inf)
    do = torch.randn(o.shape).to(dtype)
    got = [o, *torch.autograd.grad(o, leaves, do)]
    d64 = [t.detach().double().requires_grad_() for t in leaves]
    b64 = d64[3] if b is not None else None
    o64 = _attn_eager(d64[0], d64[1], d64[2], mask.double(), b64, inf)
    mask = mask.to(dtype)  # the eager formula subtracts from the mask
    ref = [o64, *torch.autograd.grad(o64, d64, do.double())]
    ol = _attn_eager(q, k, v, mask, b, inf)
    base = [ol, *torch.autograd.grad(ol, leaves, do)]
    for name, g, r, bl in zip(["o", "dq", "dk", "dv", "dbias"], got, ref, base):
        assert g.dtype == dtype and g.shape == r.shape, name
        assert_rel_close(g, r, dtype, tol=1e-5 if dtype == torch.float32 else None,
                         baseline=None if dtype == torch.float32 else bl, name=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attn_tri_openfold_layout_matches_float64(backend_name, dtype):
    # [1, B, H, N, D] with a [1, B, 1, 1, NK] mask and a [1, 1, H, NQ, NK] bias; ragged NQ != NK, D = 20.
    q, k, v, mask, b = _attn_inputs((1, 2), 2, 19, 37, 20, dtype)
    _check_attn(lambda *a: AttnTri(*a, True), q, k, v, mask, b, dtype)


def test_attn_no_bias_4d_noncontiguous(backend_name):
    q, k, v, mask, _ = _attn_inputs((2,), 2, 17, 17, 12, torch.float32, bias=False)
    qt = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()  # strided view
    _check_attn(lambda q_, k_, v_, m_, b_, inf: AttnNoBiasJIT(q_, k_, v_, m_, inf), qt, k, v, mask, None,
                torch.float32)


def test_attn_4d_takes_no_reshape(backend_name):
    """[Z, H, N, D] is the kernels' own layout: the output and the gradients are the kernels' tensors, with
    no reshape or view around them (an operator call each)."""
    if backend_name != "triton":
        pytest.skip("the PyTorch path's result comes from its own operators")
    q, k, v, mask, b = _attn_inputs((2,), 2, 9, 14, 16, torch.float32)
    q, k, v, b = (t.reshape(t.shape[-4:]) if t.dim() > 4 else t for t in (q, k, v, b))
    o = AttnTri(q, k, v, None, None)
    grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
    assert o._base is None and all(g._base is None for g in grads)


def test_attn_leading_dims_take_no_reshape(backend_name):
    """OpenFold's [1, B, H, N, D] with its broadcast mask and bias: the kernels read q, k, v, the mask and the
    bias through merged leading strides, and the output and q/k/v gradients come back in the inputs' shapes
    without a reshape or view (an operator call each)."""
    if backend_name != "triton":
        pytest.skip("the PyTorch path's result comes from its own operators")
    q, k, v, mask, b = _attn_inputs((1, 2), 2, 9, 14, 16, torch.float32)
    o = AttnTri(q, k, v, mask, b)
    grads = torch.autograd.grad(o, (q, k, v, b), torch.ones_like(o))
    assert o._base is None and all(g._base is None for g in grads[:3])
    assert o.shape == q.shape and [g.shape for g in grads] == [q.shape, k.shape, v.shape, b.shape]


def test_attn_leading_dims_of_any_strides(backend_name):
    """Leading dims that merge into one stride although a size-1 dim carries an odd stride (a tensor
    PyTorch calls contiguous), and leading dims that do not merge (then reshaped): float64 accuracy both."""
    q, k, v, mask, b = _attn_inputs((2, 1), 2, 9, 14, 16, torch.float32)
    odd = torch.empty_strided(q.shape, (2 * 9 * 16, 7, 9 * 16, 16, 1), dtype=q.dtype)
    assert odd.is_contiguous()
    qo = odd.copy_(q.detach()).requires_grad_()
    _check_attn(lambda *a: AttnTri(*a, True), qo, k, v, mask, b, torch.float32)
    q2, k2, v2, mask2, b2 = _attn_inputs((3, 2), 2, 9, 14, 16, torch.float32)
    qt = q2.detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # (3, 2) not mergeable
    _check_attn(lambda *a: AttnTri(*a, True), qt, k2, v2, mask2, b2, torch.float32)


def test_attn_without_gradient_records_nothing(backend_name, monkeypatch):
    """Under no_grad (AttnTri's is_training=False) the Triton path runs its kernels without the autograd
    Function (no context, nothing saved): the same output as with a graph."""
    import apex.ops.openfold_attention as OA

    q, k, v, mask, b = _attn_inputs((1, 2), 2, 9, 14, 16, torch.float32)
    ref = AttnTri(q, k, v, mask, b)

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(OA._AttentionTriton, "forward", staticmethod(refuse))
    o = AttnTri(q, k, v, mask, b, is_training=False)
    assert o.grad_fn is None and torch.equal(o, ref.detach())


def test_attn_bias_jit_bool_mask_and_full_bias(backend_name):
    q, k, v, mask, _ = _attn_inputs((2,), 2, 9, 14, 16, torch.float32, bias=False)
    b = torch.randn(2, 2, 9, 14).requires_grad_()  # a bias as large as the scores
    _check_attn(AttnBiasJIT, q, k, v, mask.bool(), b, torch.float32)


def test_attn_without_mask(backend_name):
    q, k, v, _, b = _attn_inputs((1, 1), 2, 10, 13, 8, torch.float32)
    leaves = (q, k, v, b)
    o = AttnTri(q, k, v, None, b)
    do = torch.randn(o.shape)
    d64 = [t.detach().double().requires_grad_() for t in leaves]
    o64 = _attn_eager(*d64[:3], None, d64[3], 1e9)
    for name, g, r in zip(["o", "dq", "dk", "dv", "dbias"], [o, *torch.autograd.grad(o, leaves, do)],
                          [o64, *torch.autograd.grad(o64, d64, do.double())]):
        assert_rel_close(g, r, torch.float32, tol=1e-5, name=name)


@pytest.mark.parametrize("lead", [(2,), (1, 2), (2, 3)])
def test_attn_without_mask_and_bias(backend_name, lead):
    """No mask and no bias on contiguous inputs (the kernels read them at the strides their layout implies),
    ragged NQ != NK, 4-D and with leading dims: float64 accuracy of the output and q/k/v gradients, also with
    a size-1 leading dim of an odd stride (a tensor PyTorch calls contiguous)."""
    q, k, v, _, _ = _attn_inputs(lead, 3, 11, 19, 8, torch.float32, bias=False)
    cases = [(q, k, v)]
    if lead == (1, 2):
        odd = torch.empty_strided(k.shape, (5, 3 * 19 * 8, 19 * 8, 8, 1), dtype=k.dtype)
        assert odd.is_contiguous()
        cases.append((q, odd.copy_(k.detach()).requires_grad_(), v))
    for q_, k_, v_ in cases:
        leaves = (q_, k_, v_)
        o = AttnTri(q_, k_, v_, None, None)
        do = torch.randn(o.shape)
        d64 = [t.detach().double().requires_grad_() for t in leaves]
        o64 = _attn_eager(*d64, None, None, 1e9)
        for name, g, r in zip(["o", "dq", "dk", "dv"], [o, *torch.autograd.grad(o, leaves, do)],
                              [o64, *torch.autograd.grad(o64, d64, do.double())]):
            assert_rel_close(g, r, torch.float32, tol=1e-5, name=name)


def test_attn_tri_not_training_records_no_graph(backend_name):
    q, k, v, mask, b = _attn_inputs((1, 2), 2, 8, 8, 16, torch.float32)
    o = AttnTri(q, k, v, mask, b, 1e9, False)
    assert o.grad_fn is None
    assert_rel_close(o, _attn_eager(q.double(), k.double(), v.double(), mask.double(), b.double(), 1e9),
                     torch.float32, tol=1e-5)


def test_attn_bad_arguments_raise():
    q, k, v, mask, b = _attn_inputs((1, 2), 2, 8, 8, 16, torch.float32)
    with pytest.raises(ValueError, match="key"):
        AttnTri(q, k[..., :4, :], v, mask, b)
    with pytest.raises(ValueError, match="bias"):
        AttnTri(q, k, v, mask, torch.randn(3, 8, 8))
    with pytest.raises(TypeError, match="dtype"):
        AttnTri(q, k.half(), v, mask, b)
    with pytest.raises(ValueError, match="inf"):
        AttnTri(q, k, v, mask, b, -1.0)


def test_mha_switch_and_can_schedule():
    assert mha.is_enabled() is False
    mha.enable()
    try:
        assert mha.is_enabled() is True
        assert mha.SWITCH.enabled
    finally:
        mha.disable()
    assert mha.is_enabled() is False
    assert CanSchTriMHA([1, 256, 4, 256, 16], True, 1e9, True)
    assert CanSchTriMHA([8, 4, 100, 24], False)
    assert not CanSchTriMHA([2, 256, 4, 256, 16])        # 5-D needs a leading 1 (as upstream)
    assert not CanSchTriMHA([1, 16, 4, 64, 512])         # head dim too large
    assert not CanSchTriMHA([1, 16, 4, 64, 32], inf=float("inf"))


def test_attn_compiles_in_one_graph():
    """``torch.compile(fullgraph=True)`` of ``AttnTri`` (CPU tensors: PyTorch's path, as "auto" chooses while
    tracing): no graph break on apex's backend context (a ContextVar Dynamo cannot read), and the values and
    gradients of the float64 formula."""
    q, k, v, mask, b = _attn_inputs((1, 2), 2, 8, 8, 16, torch.float32)
    fn = torch.compile(lambda q, k, v, m, b, inf: AttnTri(q, k, v, m, b, inf), fullgraph=True, backend="eager")
    _check_attn(fn, q, k, v, mask, b, torch.float32)
