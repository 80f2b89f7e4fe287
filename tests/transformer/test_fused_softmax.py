"""apex.transformer.functional.fused_softmax: Apex's module API, Megatron-LM's call pattern, the compatibility
modules' call patterns, and torch.compile of an attention block."""

from __future__ import annotations

import pytest
import torch

from apex.testing import assert_rel_close
from apex.transformer.enums import AttnMaskType
from apex.transformer.functional import (
    FusedScaleMaskSoftmax,
    GenericFusedScaleMaskSoftmax,
    GenericScaledMaskedSoftmax,
    ScaledMaskedSoftmax,
    ScaledSoftmax,
    ScaledUpperTriangMaskedSoftmax,
    generic_scaled_masked_softmax,
    scaled_masked_softmax,
    scaled_softmax,
    scaled_upper_triang_masked_softmax,
)

NEG = torch.finfo(torch.float64).min / 4


def attention_mask_func(scores, mask):
    return scores.masked_fill(mask, -10000.0)


def _ref(x, mask, scale, causal, dy):
    """float64 probabilities and input gradient; fully masked rows are zeros."""
    x64 = x.detach().double().requires_grad_()
    masked = torch.zeros(x.shape, dtype=torch.bool)
    if causal:
        masked = masked | torch.ones(x.shape[-2:], dtype=torch.bool).triu(1)
    if mask is not None:
        masked = masked | mask
    alive = (~masked.all(-1, keepdim=True)).double()
    y = torch.softmax((x64 * scale).masked_fill(masked, NEG), -1) * alive
    (dx,) = torch.autograd.grad(y, x64, dy.double())
    return y.detach(), dx


def _module(dtype, mask_type, fusion=True, scale=None, softmax_in_fp32=True):
    return FusedScaleMaskSoftmax(input_in_fp16=dtype == torch.float16, input_in_bf16=dtype == torch.bfloat16,
                                 attn_mask_type=mask_type, scaled_masked_softmax_fusion=fusion,
                                 mask_func=attention_mask_func, softmax_in_fp32=softmax_in_fp32, scale=scale)


def _tol(dtype):
    return 1e-6 if dtype == torch.float32 else None


# ------------------------------------------------------------------------------------------ module API
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mask_type", [AttnMaskType.padding, AttnMaskType.causal], ids=str)
@pytest.mark.parametrize("scale", [None, 0.5])
def test_module_fused_matches_reference_and_unfused(backend_name, dtype, mask_type, scale):
    causal = mask_type == AttnMaskType.causal
    shape = (2, 3, 7, 7) if causal else (2, 3, 5, 19)   # shapes upstream's kernel refuses
    x = (2 * torch.randn(shape)).to(dtype).requires_grad_()
    mask = (torch.rand(shape[0], 1, *shape[2:]) < 0.3) if not causal else None
    dy = torch.randn(shape).to(dtype)
    fused = _module(dtype, mask_type, True, scale)
    assert fused.is_kernel_available(mask, *shape)
    y = fused(x, mask)
    (dx,) = torch.autograd.grad(y, x, dy)
    ref_y, ref_dx = _ref(x, mask, scale or 1.0, causal, dy)
    # The unfused path (upstream's forward_torch_softmax) is the error budget for half precision.
    unfused = _module(dtype, mask_type, False, scale)
    assert not unfused.is_kernel_available(mask, *shape)
    tri = torch.ones(shape[-2:], dtype=torch.bool).triu(1)
    yb = unfused(x, tri if causal else mask)
    (dxb,) = torch.autograd.grad(yb, x, dy)
    assert y.dtype == dtype and dx.dtype == dtype
    assert_rel_close(y, ref_y, dtype, tol=_tol(dtype), baseline=yb if dtype != torch.float32 else None)
    assert_rel_close(dx, ref_dx, dtype, tol=_tol(dtype), baseline=dxb if dtype != torch.float32 else None)


def test_module_argument_checks():
    with pytest.raises(RuntimeError, match="both fp16 and bf16"):
        FusedScaleMaskSoftmax(True, True, AttnMaskType.padding, True, attention_mask_func, True, None)
    with pytest.raises(RuntimeError, match="softmax should be in fp32 when scaled"):
        FusedScaleMaskSoftmax(True, False, AttnMaskType.padding, True, attention_mask_func, False, 2.0)
    with pytest.raises(ValueError, match="attn_mask_type"):
        FusedScaleMaskSoftmax(True, False, "padding", True, attention_mask_func, True, None)
    m = _module(torch.float16, AttnMaskType.padding)
    with pytest.raises(ValueError, match=r"input must be a 4-D"):
        m(torch.randn(3, 4, 4).half(), None)
    with pytest.raises(ValueError, match=r"mask of shape \[2, 1, 3, 4\] does not broadcast"):
        m(torch.randn(2, 2, 4, 4).half(), torch.zeros(2, 1, 3, 4, dtype=torch.bool))


def test_kernel_availability_is_a_hint_not_a_limit():
    pad = _module(torch.float16, AttnMaskType.padding)
    causal = _module(torch.float16, AttnMaskType.causal)
    for b, np_, sq, sk in [(1, 1, 1, 1), (3, 5, 7, 17), (1, 1, 3, 20000), (4, 12, 24, 24)]:
        assert pad.is_kernel_available(None, b, np_, sq, sk)
    assert causal.is_kernel_available(None, 3, 5, 9, 9)
    assert not causal.is_kernel_available(None, 3, 5, 1, 9)   # decoding step: the unfused path
    assert _module(torch.float32, AttnMaskType.padding).is_kernel_available(None, 2, 2, 2, 2)
    assert pad.get_batch_per_block(24, 24, 4, 12) == 8


def test_causal_module_falls_back_when_sq_differs():
    m = _module(torch.float32, AttnMaskType.causal)
    x = torch.randn(2, 2, 1, 6)
    mask = torch.zeros(1, 1, 1, 6, dtype=torch.bool)
    mask[..., 4:] = True
    torch.testing.assert_close(m(x, mask), torch.softmax(x.masked_fill(mask, -10000.0), -1))


def test_fully_masked_rows_are_zero_not_nan(backend_name):
    m = _module(torch.float16, AttnMaskType.padding)
    x = torch.randn(2, 2, 3, 8).half().requires_grad_()
    mask = torch.zeros(2, 1, 3, 8, dtype=torch.bool)
    mask[1, :, 2] = True
    y = m(x, mask)
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert (y[1, :, 2] == 0).all() and (dx[1, :, 2] == 0).all()


@pytest.mark.parametrize("fusion", [True, False])
def test_generic_module(backend_name, fusion):
    m = GenericFusedScaleMaskSoftmax(True, False, fusion, attention_mask_func, True, 0.5)
    assert m.is_kernel_available(None, 1, 1, 1, 1) == fusion
    x = torch.randn(2, 3, 2, 1).half().requires_grad_()
    mask = torch.rand(2, 1, 2, 1) < 0.5
    mask[0] = False
    y = m(x, mask)
    if fusion:
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        ref_y, ref_dx = _ref(x, mask, 0.5, False, dy)
        assert_rel_close([y, dx], [ref_y, ref_dx], torch.float16)
    else:
        torch.testing.assert_close(y[0], torch.ones(3, 2, 1).half())


def test_autocast_casts_scores_to_the_autocast_dtype():
    m = _module(torch.bfloat16, AttnMaskType.padding)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)
    mask = torch.rand(2, 1, 8, 8) < 0.3
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x, mask)
    assert y.dtype == torch.bfloat16
    dy = torch.randn(2, 4, 8, 8)
    (dx,) = torch.autograd.grad(y, x, dy.bfloat16())
    assert dx.dtype == torch.float32
    ref_y, _ = _ref(x.bfloat16(), mask, 1.0, False, dy)
    assert_rel_close(y, ref_y, torch.bfloat16)


# -------------------------------------------------------------------------------- Functions and functions
def test_autograd_functions_with_upstream_signatures(backend_name):
    x = torch.randn(2, 3, 6, 6).half().requires_grad_()
    mask = torch.rand(2, 1, 6, 6) < 0.3
    dy = torch.randn(2, 3, 6, 6).half()
    cases = [
        (lambda: ScaledMaskedSoftmax.apply(x, mask, 0.7), mask, False),
        (lambda: GenericScaledMaskedSoftmax.apply(x, mask, 0.7), mask, False),
        (lambda: ScaledSoftmax.apply(x, 0.7), None, False),
        (lambda: ScaledUpperTriangMaskedSoftmax.apply(x.view(6, 6, 6), 0.7).view(2, 3, 6, 6), None, True),
        (lambda: scaled_masked_softmax(x, mask, 0.7), mask, False),
        (lambda: scaled_masked_softmax(x, None, 0.7), None, False),
        (lambda: generic_scaled_masked_softmax(x, mask, 0.7), mask, False),
        (lambda: scaled_softmax(x, 0.7), None, False),
        (lambda: scaled_upper_triang_masked_softmax(x, None, 0.7), None, True),
    ]
    for i, (fn, m, causal) in enumerate(cases):
        y = fn()
        (dx,) = torch.autograd.grad(y, x, dy)
        ref_y, ref_dx = _ref(x, m, 0.7, causal, dy)
        assert y.dtype == torch.float16 and dx.dtype == torch.float16
        assert_rel_close([y, dx], [ref_y, ref_dx], torch.float16, name=f"case {i}")


def test_upper_triang_function_rejects_cross_attention():
    with pytest.raises(ValueError, match="sq == sk"):
        scaled_upper_triang_masked_softmax(torch.randn(1, 2, 3, 4), None, 1.0)


# ------------------------------------------------------------------------- Megatron-LM's call pattern
class _MegatronUpperTriang(torch.autograd.Function):
    """Megatron-LM's ``fused_softmax.py`` calls the compiled modules like this (scale as a tensor)."""

    @staticmethod
    def forward(ctx, inputs, scale):
        import scaled_upper_triang_masked_softmax_cuda

        scale_t = torch.tensor([scale])
        out = scaled_upper_triang_masked_softmax_cuda.forward(inputs, scale_t[0])
        ctx.save_for_backward(out, scale_t)
        return out

    @staticmethod
    def backward(ctx, grads):
        import scaled_upper_triang_masked_softmax_cuda

        out, scale_t = ctx.saved_tensors
        return scaled_upper_triang_masked_softmax_cuda.backward(grads, out, scale_t[0]), None


class _MegatronMasked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, mask, scale):
        import scaled_masked_softmax_cuda

        scale_t = torch.tensor([scale])
        out = scaled_masked_softmax_cuda.forward(inputs, mask, scale_t[0])
        ctx.save_for_backward(out, scale_t)
        return out

    @staticmethod
    def backward(ctx, grads):
        import scaled_masked_softmax_cuda

        out, scale_t = ctx.saved_tensors
        return scaled_masked_softmax_cuda.backward(grads, out, scale_t[0]), None, None


class _MegatronScaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inputs, scale):
        import scaled_softmax_cuda

        scale_t = torch.tensor([scale])
        out = scaled_softmax_cuda.forward(inputs, scale_t[0])
        ctx.save_for_backward(out, scale_t)
        return out

    @staticmethod
    def backward(ctx, grads):
        import scaled_softmax_cuda

        out, scale_t = ctx.saved_tensors
        return scaled_softmax_cuda.backward(grads, out, scale_t[0]), None, None   # sic: Megatron's extra None


def _megatron_fused(x, mask, scale, causal):
    import scaled_masked_softmax_cuda

    b, np_, sq, sk = x.size()
    assert scaled_masked_softmax_cuda.get_batch_per_block(sq, sk, b, np_) > 0
    if causal:
        return _MegatronUpperTriang.apply(x.view(-1, sq, sk), scale).view(b, np_, sq, sk)
    if mask is not None:
        return _MegatronMasked.apply(x, mask, scale)
    return _MegatronScaled.apply(x, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["causal", "padding", "none"])
def test_megatron_call_pattern(backend_name, dtype, kind):
    shape = (2, 4, 16, 16) if kind == "causal" else (2, 4, 12, 40)
    x = torch.randn(shape).to(dtype).requires_grad_()
    mask = torch.rand(shape[0], 1, *shape[2:]) < 0.3 if kind == "padding" else None
    dy = torch.randn(shape).to(dtype)
    y = _megatron_fused(x, mask, 0.125, kind == "causal")
    (dx,) = torch.autograd.grad(y, x, dy)
    ref_y, ref_dx = _ref(x, mask, 0.125, kind == "causal", dy)
    assert y.dtype == dtype and dx.dtype == dtype
    assert_rel_close([y, dx], [ref_y, ref_dx], dtype)


# ---------------------------------------------------------------------------------------- torch.compile
class _Attention(torch.nn.Module):
    def __init__(self, hidden, heads, mask_type):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.out = torch.nn.Linear(hidden, hidden)
        self.softmax = FusedScaleMaskSoftmax(False, False, mask_type, True, attention_mask_func, True,
                                             1.0 / self.d ** 0.5)

    def forward(self, h, mask):
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)
        probs = self.softmax(q @ k.transpose(-1, -2), mask)
        return self.out((probs @ v).transpose(1, 2).reshape(b, s, -1))


# Inductor for one mask type (the real CPU compile path), the cheaper aot_eager tracer for the other.
@pytest.mark.parametrize("mask_type,backend", [(AttnMaskType.causal, "inductor"), (AttnMaskType.padding, "aot_eager")],
                         ids=str)
def test_torch_compile_fullgraph_matches_eager(mask_type, backend):
    torch.manual_seed(0)
    model = _Attention(32, 4, mask_type)
    h = torch.randn(2, 9, 32, requires_grad=True)
    mask = (torch.rand(2, 1, 9, 9) < 0.3) if mask_type == AttnMaskType.padding else None
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y_eager = model(h, mask)
    g_eager = torch.autograd.grad(y_eager.square().sum(), [h, *model.parameters()])
    y_comp = compiled(h, mask)
    g_comp = torch.autograd.grad(y_comp.square().sum(), [h, *model.parameters()])
    torch.testing.assert_close(y_comp, y_eager)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b)
