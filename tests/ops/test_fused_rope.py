"""apex.ops.fused_rope: outputs and gradients against a float64 reference on both backends."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.ops import fused_rope as R
from apex.testing import TritonTrace, assert_rel_close
from tests import _device
from tests.ops._modes import Recorder as _Recorder

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ------------------------------------------------------------------------------------------ references
def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_ref(t, cos, sin):
    """Upstream's unfused formula in ``t``'s dtype (the tables cast to it)."""
    r = cos.shape[-1]
    x, rest = t[..., :r], t[..., r:]
    cos, sin = cos.to(t.dtype), sin.to(t.dtype)
    return torch.cat((x * cos + _rotate_half(x) * sin, rest), dim=-1)


def _thd_ref(t, cu, cos, sin):
    cu = cu.tolist()
    parts = [t[: cu[0]]]
    for a, b in zip(cu[:-1], cu[1:]):
        parts.append(_rope_ref(t[a:b].unsqueeze(1), cos[: b - a], sin[: b - a]).squeeze(1))
    parts.append(t[cu[-1]:])
    return torch.cat(parts)


def _img_ref(t, ih, iw, ch, sh, cw, sw):
    b, _, h, d = t.shape
    q1, q2 = t.reshape(b, ih, iw, h, d).chunk(2, dim=-1)
    q1 = q1 * ch[:, :ih].unsqueeze(2).to(t.dtype) + _rotate_half(q1) * sh[:, :ih].unsqueeze(2).to(t.dtype)
    q2 = q2 * cw[:, :iw].unsqueeze(1).to(t.dtype) + _rotate_half(q2) * sw[:, :iw].unsqueeze(1).to(t.dtype)
    return torch.cat([q1, q2], dim=-1).reshape(b, ih * iw, h, d)


def _grads(fn, t, dy):
    """``fn(t)`` and its gradient with respect to ``t`` (float64 copy when ``t`` is detached float64)."""
    leaf = t.detach().clone().requires_grad_() if t.dtype == torch.float64 else t
    y = fn(leaf)
    return y, torch.autograd.grad(y, leaf, dy.to(y.dtype))[0]


def _check(fn, ref_fn, t, dy, dtype, backend_name, launches=True):
    """Output and gradient of ``fn`` against the float64 ``ref_fn``, with PyTorch's own error in ``dtype``
    as the fp16/bf16 baseline; on the Triton path one launch each way and every access in bounds."""
    t64 = t.detach().double()
    ctx = TritonTrace(bounds=True).watch(t, dy) if backend_name == "triton" else contextlib.nullcontext()
    with ctx as tr:
        y, dx = _grads(fn, t, dy)
    if tr is not None and launches:
        assert tr.launches == 2 and len(tr.kernels) == 1
    ry, rdx = _grads(ref_fn, t64, dy.double())
    by, bdx = _grads(ref_fn, t.detach().clone().requires_grad_(), dy)
    assert y.dtype == dtype and dx.dtype == dtype and y.shape == ry.shape
    tol = 1e-6 if dtype == torch.float32 else None
    assert_rel_close(y, ry, dtype, tol=tol, baseline=by if tol is None else None, name="y")
    assert_rel_close(dx, rdx, dtype, tol=tol, baseline=bdx if tol is None else None, name="dx")
    return y, dx


def _layout(x, how):
    """The same values in another memory layout."""
    if how == "contiguous":
        return x
    if how == "sb_swapped":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if how == "hd_swapped":
        return x.transpose(2, 3).contiguous().transpose(2, 3)
    big = torch.empty(*x.shape[:-1], x.shape[-1] + 5, dtype=x.dtype)  # row padding: a strided slice
    big[..., 2:2 + x.shape[-1]] = x
    return big[..., 2:2 + x.shape[-1]]


# -------------------------------------------------------------------------------------------- sbhd
@pytest.mark.parametrize("layout,transpose_out", [("contiguous", False), ("contiguous", True), ("sb_swapped", True),
                                                  ("hd_swapped", False), ("sliced", True)])
@pytest.mark.parametrize("rot", [24, 10])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_sbhd_matches_float64(backend_name, dtype, rot, layout, transpose_out):
    s, b, h, d = 7, 3, 5, 24
    t = _layout(torch.randn(s, b, h, d).to(dtype), layout).requires_grad_()
    freqs = torch.rand(s, 1, 1, rot) * 6
    dy = torch.randn(s, b, h, d).to(dtype)
    y, dx = _check(lambda x: R.fused_rope(x, freqs, transpose_out),
                   lambda x: _rope_ref(x, freqs.double().cos(), freqs.double().sin()), t, dy, dtype, backend_name)
    assert y.transpose(0, 1).is_contiguous() is transpose_out
    assert dx.transpose(0, 1).is_contiguous() is transpose_out


@pytest.mark.parametrize("table_dtype", ["float32", "same"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_cached_matches_float64(backend_name, dtype, table_dtype):
    s, b, h, d, rot = 9, 2, 3, 20, 12
    t = torch.randn(s, b, h, d).to(dtype).requires_grad_()
    freqs = torch.rand(s, 1, 1, rot) * 6
    tab = torch.float32 if table_dtype == "float32" else dtype
    cos, sin = freqs.cos().to(tab), freqs.sin().to(tab)
    dy = torch.randn(s, b, h, d).to(dtype)
    _check(lambda x: R.fused_rope_cached(x, cos, sin), lambda x: _rope_ref(x, cos.double(), sin.double()),
           t, dy, dtype, backend_name)


def test_rope_float64(backend_name):
    """float64 keeps float64 arithmetic (the Triton backend hands it to the PyTorch path)."""
    t = torch.randn(4, 2, 3, 8, dtype=torch.float64, requires_grad=True)
    freqs = torch.rand(4, 1, 1, 8, dtype=torch.float64)
    dy = torch.randn(4, 2, 3, 8, dtype=torch.float64)
    y, dx = _grads(lambda x: R.fused_rope(x, freqs), t, dy)
    ry, rdx = _grads(lambda x: _rope_ref(x, freqs.cos(), freqs.sin()), t, dy)
    assert_rel_close(y, ry, tol=1e-14)
    assert_rel_close(dx, rdx, tol=1e-14)


# The backend fixture's device switch holds for every example (it only decides where tensors are made).
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(s=st.integers(1, 9), b=st.integers(1, 3), h=st.integers(1, 6), half_d=st.integers(1, 20),
       frac=st.floats(0.0, 1.0))
def test_rope_random_shapes(backend_name, s, b, h, half_d, frac):
    d = 2 * half_d
    rot = 2 * round(frac * half_d)
    t = torch.randn(s, b, h, d, requires_grad=True)
    freqs = torch.rand(s, 1, 1, rot) * 6
    dy = torch.randn(s, b, h, d)
    ref = lambda x: _rope_ref(x, freqs.double().cos(), freqs.double().sin())  # noqa: E731
    _check(lambda x: R.fused_rope(x, freqs), ref, t, dy, torch.float32, backend_name, launches=rot > 0)


# --------------------------------------------------------------------------------------------- thd
@pytest.mark.parametrize("tail", [0, 2])
@pytest.mark.parametrize("rot", [16, 6])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_thd_three_sequences(backend_name, dtype, rot, tail):
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    tokens, h, d = 13 + tail, 3, 16
    t = _layout(torch.randn(tokens, d, h).to(dtype).transpose(1, 2), "contiguous").requires_grad_()
    assert not t.is_contiguous()
    freqs = torch.rand(8, 1, 1, rot) * 6
    dy = torch.randn(tokens, h, d).to(dtype)
    _check(lambda x: R.fused_rope_thd(x, cu, freqs),
           lambda x: _thd_ref(x, cu, freqs.double().cos(), freqs.double().sin()), t, dy, dtype, backend_name)


def test_rope_thd_empty_sequence_and_int64_offsets(backend_name):
    cu = torch.tensor([2, 2, 9, 9, 11], dtype=torch.int64)
    t = torch.randn(12, 2, 10, requires_grad=True)
    freqs = torch.rand(7, 1, 1, 10) * 6
    dy = torch.randn(12, 2, 10)
    _check(lambda x: R.fused_rope_thd(x, cu, freqs),
           lambda x: _thd_ref(x, cu, freqs.double().cos(), freqs.double().sin()), t, dy, torch.float32,
           backend_name)


# ---------------------------------------------------------------------------------------------- 2-D
@pytest.mark.parametrize("margin", [0, 3])
@pytest.mark.parametrize("layout", ["contiguous", "sb_swapped"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_2d_matches_float64(backend_name, dtype, layout, margin):
    b, ih, iw, h, d = 2, 3, 5, 2, 12
    t = _layout(torch.randn(b, ih * iw, h, d).to(dtype), layout).requires_grad_()
    eh, ew = torch.rand(1, ih + margin, 1, d // 2) * 6, torch.rand(1, iw + margin, 1, d // 2) * 6
    ch, sh, cw, sw = eh.cos().to(dtype), eh.sin().to(dtype), ew.cos().to(dtype), ew.sin().to(dtype)
    dy = torch.randn(b, ih * iw, h, d).to(dtype)
    y, _ = _check(lambda x: R.fused_rope_2d(x, ih, iw, ch, sh, cw, sw),
                  lambda x: _img_ref(x, ih, iw, *(v.double() for v in (ch, sh, cw, sw))), t, dy, dtype, backend_name)
    assert y.is_contiguous()


# --------------------------------------------------------------------------------------- entry points
def test_compat_module_forward_backward_are_transposes(backend_name):
    import fused_rotary_positional_embedding as ext

    t, g = torch.randn(5, 2, 3, 12), torch.randn(5, 2, 3, 12)
    freqs = torch.rand(5, 1, 1, 8) * 6
    # <R(t), g> == <t, Rᵀ(g)> for every pair: backward is the transpose of forward.
    for fwd, bwd, args in ((ext.forward, ext.backward, (freqs, True)),
                           (ext.forward_cached, ext.backward_cached, (freqs.cos(), freqs.sin(), False))):
        lhs = (fwd(t, *args).double() * g.double()).sum()
        rhs = (t.double() * bwd(g, *args).double()).sum()
        assert abs(lhs - rhs) <= 1e-5 * abs(lhs)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    lhs = (ext.forward_thd(t[:, 0], cu, freqs).double() * g[:, 0].double()).sum()
    rhs = (t[:, 0].double() * ext.backward_thd(g[:, 0], cu, freqs).double()).sum()
    assert abs(lhs - rhs) <= 1e-5 * abs(lhs)
    x5, g4 = torch.randn(2, 2, 3, 1, 12), torch.randn(2, 6, 1, 12)
    ch, sh, cw, sw = (torch.rand(1, 4, 1, 6) for _ in range(4))
    y = ext.forward_2d(x5, ch, sh, cw, sw)
    assert y.shape == (2, 6, 1, 12)
    lhs = (y.double() * g4.double()).sum()
    rhs = (x5.double() * ext.backward_2d(g4.view(2, 2, 3, 1, 12), ch, sh, cw, sw).double().view(2, 2, 3, 1, 12)).sum()
    assert abs(lhs - rhs) <= 1e-5 * abs(lhs)


# ---------------------------------------------------------------------------------------------- errors
# Each bad call, the message it must give and the two types it must be: this package's (ValueError for a
# value, TypeError for a type) and the one NVIDIA Apex raised there (RuntimeError from TORCH_CHECK in its C++
# entry points, AssertionError from the 2-D wrapper's asserts).
VR, TR, VA = (ValueError, RuntimeError), (TypeError, RuntimeError), (ValueError, AssertionError)


def _bad_calls():
    import fused_rotary_positional_embedding as ext

    t4, f = torch.randn(4, 2, 3, 8), torch.rand(4, 1, 1, 8)
    t3 = torch.randn(10, 2, 8)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    tab = torch.rand(1, 3, 1, 4)
    t5 = torch.randn(2, 3, 3, 1, 8)
    return [
        # sbhd, forward and backward
        ("t must be a 4-D", VR, lambda: R.fused_rope(t4[0], f)),
        ("freqs's last dim", VR, lambda: R.fused_rope(t4, torch.rand(4, 1, 1, 5))),
        ("freqs's last dim", VR, lambda: R.fused_rope(t4, torch.rand(4, 1, 1, 10))),
        ("freqs has 3 positions but t has sequence length 4", VR, lambda: R.fused_rope(t4, torch.rand(3, 1, 1, 8))),
        ("freqs has 6 positions but t has sequence length 4", VR, lambda: R.fused_rope(t4, torch.rand(6, 1, 1, 8))),
        ("shape", VR, lambda: R.fused_rope(t4, torch.rand(4, 2, 1, 8))),
        ("freqs must be float32", TR, lambda: R.fused_rope(t4.half(), f.half())),
        ("freqs must be float32, got torch.float64", TR, lambda: R.fused_rope(t4, f.double())),
        ("freqs has 5 positions but input has", VR, lambda: ext.forward(t4, torch.rand(5, 1, 1, 8), False)),
        ("freqs has 5 positions but output_grads has", VR, lambda: ext.backward(t4, torch.rand(5, 1, 1, 8), True)),
        ("output_grads must be a 4-D", VR, lambda: ext.backward(t3, f, False)),
        # cached
        ("cos_ has 5 positions but t has sequence length 4", VR,
         lambda: R.fused_rope_cached(t4, torch.rand(5, 1, 1, 8), f.sin())),
        ("sin_ has 3 positions", VR, lambda: R.fused_rope_cached(t4, f.cos(), torch.rand(3, 1, 1, 8))),
        ("same shape and dtype", VR, lambda: R.fused_rope_cached(t4.half(), f.cos(), f.sin().half())),
        ("same shape and dtype", VR, lambda: R.fused_rope_cached(t4, f.cos(), f[..., :6].sin())),
        ("cos_ must be float32 or t's dtype", TR, lambda: R.fused_rope_cached(t4, f.cos().bfloat16(), f.sin())),
        ("sin_ has 6 positions but t", VR, lambda: R.fused_rope_cached(t4, f.cos(), torch.rand(6, 1, 1, 8))),
        ("cos has 5 positions but output_grads", VR,
         lambda: ext.backward_cached(t4, torch.rand(5, 1, 1, 8), torch.rand(5, 1, 1, 8), False)),
        ("sin must have shape", VR, lambda: ext.forward_cached(t4, f, torch.rand(4, 1, 2, 8), False)),
        # thd
        ("non-decreasing", VR, lambda: R.fused_rope_thd(t3, torch.tensor([0, 6, 4, 10], dtype=torch.int32), f)),
        ("lie in", VR, lambda: R.fused_rope_thd(t3, torch.tensor([0, 4, 11], dtype=torch.int32), f)),
        ("only 4 positions", VR, lambda: R.fused_rope_thd(t3, torch.tensor([0, 5, 10]), f)),
        ("int32/int64", TR, lambda: R.fused_rope_thd(t3, cu.float(), f)),
        ("at least one element", VR, lambda: R.fused_rope_thd(t3, cu[:0], f)),
        ("cu_seqlens must be a 1-D", VR, lambda: R.fused_rope_thd(t3, cu[None], f)),
        ("t must be a 3-D", VR, lambda: R.fused_rope_thd(t4, cu, f)),
        ("freqs must be float32", TR, lambda: R.fused_rope_thd(t3, cu, f.bfloat16())),
        ("freqs's last dim", VR, lambda: R.fused_rope_thd(t3, cu, torch.rand(6, 1, 1, 10))),
        ("freqs must have shape", VR, lambda: ext.backward_thd(t3, cu, torch.rand(6, 2, 1, 8))),
        ("output_grads must be a 3-D", VR, lambda: ext.backward_thd(t4, cu, f)),
        # 2-D
        ("img_h \\* img_w", VA, lambda: R.fused_rope_2d(torch.randn(2, 8, 1, 8), 3, 3, tab, tab, tab, tab)),
        ("positive ints", VA, lambda: R.fused_rope_2d(torch.randn(2, 0, 1, 8), 0, 3, tab, tab, tab, tab)),
        ("cos_h and sin_h must have the same", VA,
         lambda: R.fused_rope_2d(torch.randn(2, 9, 1, 8), 3, 3, tab, torch.rand(1, 4, 1, 4), tab, tab)),
        ("cos_w and sin_w must have the same", VA,
         lambda: R.fused_rope_2d(torch.randn(2, 9, 1, 8), 3, 3, tab, tab, tab, tab.half())),
        ("head dim / 2", VR, lambda: R.fused_rope_2d(torch.randn(2, 9, 1, 10), 3, 3, tab, tab, tab, tab)),
        ("even", VR, lambda: R.fused_rope_2d(torch.randn(2, 9, 1, 7), 3, 3, tab, tab, tab, tab)),
        ("cos_w has 3 positions, fewer than the 4", VR,
         lambda: R.fused_rope_2d(torch.randn(2, 12, 1, 8), 3, 4, tab, tab, tab, tab)),
        ("cos_h must have shape", VR,
         lambda: R.fused_rope_2d(torch.randn(2, 9, 1, 8), 3, 3, *[torch.rand(1, 3, 2, 4)] * 2, tab, tab)),
        ("cos_h must be float32 or t's dtype", TR,
         lambda: R.fused_rope_2d(torch.randn(2, 9, 1, 8), 3, 3, tab.half(), tab.half(), tab, tab)),
        ("input must be a 5-D", VR, lambda: ext.forward_2d(t4, tab, tab, tab, tab)),
        ("cos_h has 3 positions, fewer than the 4", VR,
         lambda: ext.backward_2d(torch.randn(2, 4, 3, 1, 8), tab, tab, tab, tab)),
        ("sin_w must be a 4-D", VR, lambda: ext.forward_2d(t5, tab, tab, tab, tab[0])),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls())))
def test_rope_bad_input_raises_clear_errors(backend_name, case):
    match, (ours, apex_type), call = _bad_calls()[case]
    with pytest.raises(ours, match=match) as info:
        call()
    assert isinstance(info.value, apex_type), f"{type(info.value).__mro__} is not also {apex_type.__name__}"


def test_rope_wrong_types():
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        R.fused_rope([1.0], torch.rand(1, 1, 1, 2))
    with pytest.raises(TypeError, match="float32, float16") as info:
        R.fused_rope(torch.ones(2, 1, 1, 4, dtype=torch.int32), torch.rand(2, 1, 1, 4))
    assert isinstance(info.value, RuntimeError)  # Apex's dtype dispatch raised RuntimeError


def test_rope_triton_moves_the_minimum_bytes(triton_device):
    """One launch each way (also compiled on a GPU); the byte counts need the interpreter (skipped there)."""
    s, b, h, d, rot = 6, 2, 4, 32, 16
    t = torch.randn(s, b, h, d, requires_grad=True)
    freqs = torch.rand(s, 1, 1, rot)
    dy = torch.randn(s, b, h, d)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        y = R.fused_rope(t, freqs)
    assert tr.launches == 1
    minimum = 2 * t.nbytes + freqs.nbytes
    assert tr.bytes_unique <= 1.05 * minimum, (tr.bytes_unique, minimum)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        torch.autograd.grad(y, t, dy)
    assert tr.launches == 1 and tr.bytes_unique <= 1.05 * minimum


@pytest.mark.parametrize("variant", ["freqs", "cached", "thd", "2d"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_rope_half_matches_upstream_arithmetic(backend_name, dtype, variant):
    """fp16/bf16 round like upstream's kernel (tables, products, sum in the dtype), so upstream's own test
    criterion, ``assertEqual`` against its unfused formula in that dtype, holds: torch's default
    tolerances for the dtype (rtol 1e-3 / 1.6e-2, atol 1e-5) on values and gradients."""
    t = torch.rand(12, 2, 3, 32).to(dtype)
    emb = torch.rand(12, 1, 1, 16)
    c, s = emb.cos(), emb.sin()
    if variant == "freqs":
        ours, ref = (lambda x: R.fused_rope(x, emb)), (lambda x: _rope_ref(x, c, s))
    elif variant == "cached":
        ours, ref = (lambda x: R.fused_rope_cached(x, c, s)), (lambda x: _rope_ref(x, c, s))
    elif variant == "thd":
        t = t[:, 0]
        cu = torch.tensor([0, 4, 5, 12], dtype=torch.int32)
        ours, ref = (lambda x: R.fused_rope_thd(x, cu, emb)), (lambda x: _thd_ref(x, cu, c, s))
    else:
        t = t.reshape(2, 12, 3, 32)
        ch, sh, cw, sw = (v.reshape(1, 12, 1, 16)[:, :6].to(dtype) for v in (c, s, c.flip(0), s.flip(0)))
        ours = lambda x: R.fused_rope_2d(x, 3, 4, ch, sh, cw, sw)  # noqa: E731
        ref = lambda x: _img_ref(x, 3, 4, ch, sh, cw, sw)  # noqa: E731
    dy = torch.full(t.shape, 2.0, dtype=dtype)  # upstream's loss: output.sum() * 2
    y, dx = _grads(ours, t.clone().requires_grad_(), dy)
    ry, rdx = _grads(ref, t.clone().requires_grad_(), dy)
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(dx, rdx)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rope_half_error_is_near_the_once_rounded_formula(backend_name, dtype):
    """Full rotary dim, angles uniform in ±4: output and gradient err at most 2x as much as the fp32 formula
    rounded once to the dtype. Apex's arithmetic (cos/sin, each product and the sum rounded) measures 1.65x;
    an angle rounded to the dtype before cos/sin, or fp32 -> bf16 truncated instead of rounded (the bare
    Triton interpreter does that: 4.7x), exceeds the bound."""
    s, b, h, d = 16, 2, 4, 64
    t = torch.randn(s, b, h, d).to(dtype).requires_grad_()
    freqs = torch.rand(s, 1, 1, d) * 8 - 4
    dy = torch.randn(s, b, h, d).to(dtype)
    y, dx = _grads(lambda x: R.fused_rope(x, freqs), t, dy)

    def rotation(x, f, transpose=False):  # the forward rotation, or its transpose (the gradient)
        c, sn = f.cos(), f.sin()
        if transpose:
            g1, g2 = (x * sn).chunk(2, dim=-1)
            return x * c + torch.cat((g2, -g1), dim=-1)
        return x * c + _rotate_half(x) * sn

    for name, ours, x, transpose in (("y", y, t.detach(), False), ("dx", dx, dy, True)):
        exact = rotation(x.double(), freqs.double(), transpose)
        once = rotation(x.float(), freqs, transpose).to(dtype)
        err, err_once = (float((v.detach().double() - exact).norm() / exact.norm()) for v in (ours, once))
        assert err <= 2 * err_once, f"{name}: {err:.3e} > 2 x {err_once:.3e} (the fp32 formula rounded once)"


# ------------------------------------------------------------------------------- eager path and tracers
NEEDS_PLAIN_TENSORS = pytest.mark.skipif(
    _device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops under a dispatch mode, which "
    "takes the registered op by design")


def _custom_op_calls(monkeypatch) -> list:
    """Every call of an apex custom op's Python entry (``CustomOp.__call__``) from now on."""
    from apex.ops._dispatch import CustomOp

    calls: list = []
    call = CustomOp.__call__

    def counted(self, *args):
        calls.append(self)
        return call(self, *args)

    monkeypatch.setattr(CustomOp, "__call__", counted)
    return calls


def _layout_call(layout, dev):
    s, b, h, d = 6, 2, 3, 16
    if layout == "thd":
        t = torch.randn(12, h, d, device=dev, requires_grad=True)
        cu, freqs = torch.tensor([0, 5, 12], device=dev, dtype=torch.int32), torch.randn(7, 1, 1, d, device=dev)
        return t, (lambda: R.fused_rope_thd(t, cu, freqs)), (t, freqs, None, None, None, cu, R.THD, 1, False, False)
    t = torch.randn(s, b, h, d, device=dev, requires_grad=True)
    if layout == "cached":
        f = torch.randn(s, 1, 1, d, device=dev)
        cos, sin = f.cos(), f.sin()
        return t, (lambda: R.fused_rope_cached(t, cos, sin, True)), (t, cos, sin, None, None, None, R.CACHED, 1,
                                                                     False, True)
    freqs = torch.randn(s, 1, 1, 12, device=dev)
    return t, (lambda: R.fused_rope(t, freqs)), (t, freqs, None, None, None, None, R.SBHD, 1, False, False)


@NEEDS_PLAIN_TENSORS
@pytest.mark.parametrize("layout", ["sbhd", "cached", "thd"])
def test_rope_eager_forward_and_backward_rotate_without_the_custom_op(triton_device, monkeypatch, layout):
    """In eager mode on plain tensors neither the forward nor the backward goes through the custom op's entry
    (its checks and autograd layers cost more host time than the launch): the same values, bit for bit, as
    the registered op ``torch.ops.apex.fused_rope`` differentiated by torch.library's autograd."""
    t, call, op_args = _layout_call(layout, triton_device)
    with apex.backend("triton"):
        ref = torch.ops.apex.fused_rope(*op_args)
        dy = torch.randn_like(ref)
        (ref_dt,) = torch.autograd.grad(ref, t, dy)
        calls = _custom_op_calls(monkeypatch)
        y = call()
        (dt,) = torch.autograd.grad(y, t, dy)
        with torch.no_grad():
            y_nograd = call()
    assert calls == [], f"{len(calls)} custom-op calls in an eager forward + backward"
    assert y.stride() == ref.stride()
    for got, want in ((y, ref), (dt, ref_dt), (y_nograd, ref)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)



def test_rope_backward_under_a_dispatch_mode_and_second_derivative(triton_device):
    """A forward run eagerly whose backward runs under a dispatch mode: the mode sees the registered op, with
    the same gradient. A backward that builds a graph takes the registered op too: the rotation is linear, so
    for ``loss = Σ y²`` the gradient is ``2·t`` (the rotation is orthogonal: the halves share their angles) and
    the derivative of its sum ``2``."""
    t = torch.randn(6, 2, 3, 16, device=triton_device, requires_grad=True)
    freqs = torch.randn(6, 1, 1, 8, device=triton_device).repeat(1, 1, 1, 2)
    with apex.backend("triton"):
        expected = torch.autograd.grad(R.fused_rope(t, freqs).square().sum(), t)
        loss = R.fused_rope(t, freqs).square().sum()
        with _Recorder() as rec:
            got = torch.autograd.grad(loss, t)
        (g,) = torch.autograd.grad(R.fused_rope(t, freqs).square().sum(), t, create_graph=True)
        (gg,) = torch.autograd.grad(g.sum(), t)
    assert "apex::fused_rope" in rec.ops, rec.ops
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert_rel_close(g, 2 * t.detach(), tol=1e-5)
    assert_rel_close(gg, torch.full_like(gg, 2.0), tol=1e-5)


def _bits(t):
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _halves_cases(dev, dtype):
    """(mode, rot, x, y, tables, cu, head block, warps) launches of ``apex._kernels.fused_rope.rope``: modes 0-2
    on strided views, 5 heads (not a multiple of the head block), rotary dim below, at and far below the head dim,
    R/2 not a power of two, one angle tile and several copies (rot // 2 against 16 x warps)."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    def angles(s, r):
        return (torch.rand(s, 1, 1, r, generator=g) * 12 - 6).to(dev)

    s, b, h = 4, 2, 5
    bshd = randn(b, s, h, 24).transpose(0, 1)  # sbhd view of [b, s, h, d] memory
    padded = randn(s, b, h, 30)[..., 3:27]  # rows padded: a strided slice
    y_bshd = torch.empty(b, s, h, 24, dtype=dtype, device=dev).transpose(0, 1)
    f16, f32, f10, f0 = angles(s, 16), angles(s, 32), angles(s, 10), angles(s, 0)
    tab = torch.float32 if dtype == torch.float32 else dtype
    cu = torch.tensor([1, 4, 4, 9], dtype=torch.int32, device=dev)  # tokens 0, 9, 10 outside: pass through
    thd = randn(11, 3, 16).unsqueeze(1)
    return [
        (0, 16, bshd, y_bshd, (f16,), None, 4, 1),
        (0, 32, randn(s, b, h, 32), None, (f32,), None, 4, 1),
        (0, 0, padded, None, (f0,), None, 4, 2),
        (1, 10, padded, None, (f10.cos().to(tab), f10.sin().to(tab)), None, 4, 8),
        (1, 24, bshd, None, (angles(s, 24).cos().to(dtype), angles(s, 24).sin().to(dtype)), None, 8, 1),
        (2, 12, thd, None, (angles(8, 12),), cu, 4, 4),
        (2, 16, thd, None, (angles(8, 16),), cu, 4, 1),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_halves_match_the_full_tile_bit_for_bit(triton_device, dtype):
    """The half-tile kernel (modes 0-2: each element loaded once, each column's cos/sin once per program) gives
    the full tile's bits, forward and backward, whichever the launch configuration; thd rows outside
    ``cu_seqlens`` and the columns past the rotary dim are copies of the input."""
    from apex._kernels import _tuning
    from apex._kernels import fused_rope as K

    if triton_device.type == "meta":
        pytest.skip("compares computed values")
    for mode, rot, x, y, tables, cu, heads, warps in _halves_cases(triton_device, dtype):
        for backward in (False, True):
            op = "fused_rope.bwd" if backward else "fused_rope.fwd"
            out = []
            for halves in (0, 1):
                o = torch.empty_like(x) if y is None else torch.empty_like(y).copy_(y)
                with _tuning.override(op, heads=heads, warps=warps, halves=halves):
                    K.rope(x, o, mode, backward, rot, *tables, cu=cu, dims=(0, 3))
                    assert _tuning.last[op]["halves"] == halves
                out.append(o)
            case = (mode, rot, backward, heads, warps)
            assert torch.equal(_bits(out[1]), _bits(out[0])), case
            assert torch.equal(_bits(out[1][..., rot:]), _bits(x[..., rot:])), case
            if mode == 2:
                assert torch.equal(_bits(out[1][[0, 9, 10]]), _bits(x[[0, 9, 10]])), case


def test_rope_takes_the_half_tiles_by_default_and_under_measured_entries():
    """The formula takes the half tiles; a measured entry timed before they existed (no ``halves`` key: the full
    tile's head block and warps) keeps its head block and warps and takes them too. Planned on a meta tensor:
    nothing runs."""
    from apex._kernels import _tuning
    from apex._kernels import fused_rope as K

    x = torch.empty(4096, 4, 32, 128, dtype=torch.bfloat16, device="meta")
    for backward in (False, True):
        op = "fused_rope.bwd" if backward else "fused_rope.fwd"
        assert K._plan(x, backward)[-1]["halves"] == 1
        with _tuning.assume_device("NVIDIA H200", 132):
            measured = _tuning.lookup(op, "NVIDIA H200", 2, (4096 * 4, 32, 128))
            plan = K._plan(x, backward)
        if measured is None:
            continue
        cfg = plan[-1]
        assert (cfg["heads"], cfg["warps"], cfg["halves"]) == (measured["heads"], measured["warps"],
                                                               measured.get("halves", 1))
        assert plan[9] == (16 * cfg["warps"] if cfg["halves"] else 0)  # HALVES: half the program's threads


def test_rope_head_blocks_follow_an_override(triton_device):
    """The launch plan keeps the grid's launcher with the head block: a head block set by ``_tuning.override``
    (and the default one again after it) launches its own grid, every head rotated each way."""
    from apex._kernels import _tuning

    if triton_device.type == "meta":
        pytest.skip("compares computed values")
    s, b, h, d = 5, 2, 4, 16
    t = torch.randn(s, b, h, d, device=triton_device, requires_grad=True)
    freqs = torch.rand(s, 1, 1, d, device=triton_device) * 6
    dy = torch.randn(s, b, h, d, device=triton_device)
    t64 = t.detach().double().requires_grad_()
    ref = _rope_ref(t64, freqs.double().cos(), freqs.double().sin())
    (rdx,) = torch.autograd.grad(ref, t64, dy.double())
    with apex.backend("triton"):
        for heads in (None, 1, None, 2):
            with _tuning.override("fused_rope.fwd", heads=heads, warps=1) if heads else contextlib.nullcontext(), \
                    _tuning.override("fused_rope.bwd", heads=heads, warps=1) if heads else contextlib.nullcontext():
                y = R.fused_rope(t, freqs)
                (dx,) = torch.autograd.grad(y, t, dy)
                if heads:
                    assert _tuning.last["fused_rope.fwd"]["heads"] == heads
            assert_rel_close([y, dx], [ref, rdx], torch.float32)


def test_rope_backward_takes_the_forwards_path(triton_device):
    """The eager backward launches with the forward's choice (it does not ask the backend again): a forward on
    the Triton path is differentiated by the kernel even where the backward runs under another backend
    setting, and a PyTorch-path forward by the PyTorch path; the gradient is right either way."""
    if triton_device.type == "meta":
        pytest.skip("compares computed values")
    s, b, h, d = 5, 2, 3, 16
    t = torch.randn(s, b, h, d, device=triton_device, requires_grad=True)
    freqs = torch.rand(s, 1, 1, 12, device=triton_device) * 6
    dy = torch.randn(s, b, h, d, device=triton_device)
    t64 = t.detach().double().requires_grad_()
    (rdx,) = torch.autograd.grad(_rope_ref(t64, freqs.double().cos(), freqs.double().sin()), t64, dy.double())
    for forward_backend, backward_backend, launches in (("triton", "torch", 2), ("torch", "triton", 0)):
        with TritonTrace().watch(t, dy) as tr:
            with apex.backend(forward_backend):
                y = R.fused_rope(t, freqs)
            with apex.backend(backward_backend):
                (dx,) = torch.autograd.grad(y, t, dy)
        assert tr.launches == launches, (forward_backend, tr.launches)
        assert_rel_close(dx, rdx, torch.float32, tol=1e-6)
