"""apex.transformer.functional's RoPE, bias-activation and weight-gradient entry points: upstream names and
signatures, Megatron-LM's call patterns through the compatibility modules, and torch.compile."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from apex.testing import assert_rel_close

ROPE = ["fused_apply_rotary_pos_emb", "fused_apply_rotary_pos_emb_cached", "fused_apply_rotary_pos_emb_thd",
        "fused_apply_rotary_pos_emb_2d"]
SIGNATURES = {
    "fused_apply_rotary_pos_emb": ["t", "freqs", "transpose_output_memory"],
    "fused_apply_rotary_pos_emb_cached": ["t", "cos_", "sin_", "transpose_output_memory"],
    "fused_apply_rotary_pos_emb_thd": ["t", "cu_seqlens", "freqs"],
    "fused_apply_rotary_pos_emb_2d": ["t", "img_h", "img_w", "cos_h", "sin_h", "cos_w", "sin_w"],
    "bias_swiglu": ["input", "bias"],
    "bias_gelu": ["input", "bias"],
    "swiglu": ["input"],
    "wgrad_gemm_accum_fp32": ["input", "grad_output", "main_grad"],
    "wgrad_gemm_accum_fp16": ["input", "grad_output", "main_grad"],
}


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_public_names_and_signatures(name):
    import apex.transformer.functional as tf

    fn = getattr(tf, name)
    assert list(inspect.signature(fn).parameters) == SIGNATURES[name]
    assert name in dir(tf)


@pytest.mark.parametrize("module,names", [
    ("fused_rotary_positional_embedding", ["forward", "backward", "forward_cached", "backward_cached",
                                           "forward_thd", "backward_thd", "forward_2d", "backward_2d"]),
    ("fused_weight_gradient_mlp_cuda", ["wgrad_gemm_accum_fp32", "wgrad_gemm_accum_fp16"]),
    ("fused_bias_swiglu", ["forward", "backward"]),
])
def test_compat_modules_expose_upstream_names(module, names):
    import importlib

    mod = importlib.import_module(module)
    for n in names:
        assert callable(getattr(mod, n)), n


def _rope64(t, freqs):
    r = freqs.shape[-1]
    x, rest = t[..., :r], t[..., r:]
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x * freqs.cos() + torch.cat((-x2, x1), -1) * freqs.sin(), rest), -1)


def test_megatron_rope_call_pattern(backend_name):
    """Megatron-LM core: ``fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory=True)`` on sbhd,
    and ``fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs)`` on packed sequences."""
    from apex.transformer.functional import fused_apply_rotary_pos_emb, fused_apply_rotary_pos_emb_thd

    s, b, h, d = 6, 2, 3, 16
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(s).float(), inv)
    emb = torch.cat((freqs, freqs), -1)[:, None, None, :]  # [s, 1, 1, 8]: rotary_percent = 0.5
    t = torch.randn(s, b, h, d, requires_grad=True)
    y = fused_apply_rotary_pos_emb(t, emb, transpose_output_memory=True)
    assert y.transpose(0, 1).is_contiguous()
    t64 = t.detach().double().requires_grad_()
    ref = _rope64(t64, emb.double())
    assert_rel_close(y, ref, tol=1e-6)
    dy = torch.randn(s, b, h, d)
    (dx,) = torch.autograd.grad(y, t, dy)
    (rdx,) = torch.autograd.grad(ref, t64, dy.double())
    assert_rel_close(dx, rdx, tol=1e-6)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    y = fused_apply_rotary_pos_emb_thd(t[:, 0], cu, emb)
    ref = torch.cat([_rope64(t64[:2, 0:1], emb.double()[:2]), _rope64(t64[2:, 0:1], emb.double()[:4])])
    assert_rel_close(y, ref.squeeze(1), tol=1e-6)


class _LinearWithGradAccumulation(torch.autograd.Function):
    """Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` with gradient_accumulation_fusion."""

    @staticmethod
    def forward(ctx, input, weight):
        ctx.save_for_backward(input, weight)
        return torch.matmul(input, weight.t())

    @staticmethod
    def backward(ctx, grad_output):
        import fused_weight_gradient_mlp_cuda

        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        grad_output = grad_output.reshape(-1, grad_output.shape[-1])
        total_input = input.reshape(-1, input.shape[-1])
        if weight.main_grad.dtype == torch.float32:
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
        else:
            fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
        return grad_input, None


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_megatron_gradient_accumulation_fusion_pattern(backend_name, grad_dtype):
    dtype = torch.bfloat16 if grad_dtype == torch.bfloat16 else torch.float32
    weight = torch.nn.Parameter(torch.randn(12, 20).to(dtype))
    weight.main_grad = torch.zeros(12, 20, dtype=grad_dtype)
    ref = torch.zeros(12, 20, dtype=torch.float64)
    for _ in range(2):  # two micro-batches accumulate into main_grad
        x = torch.randn(5, 3, 20).to(dtype).requires_grad_()
        dy = torch.randn(5, 3, 12).to(dtype)
        y = _LinearWithGradAccumulation.apply(x, weight)
        y.backward(dy)
        ref += dy.double().reshape(-1, 12).t() @ x.detach().double().reshape(-1, 20)
        assert weight.grad is None
    assert_rel_close(weight.main_grad, ref, grad_dtype, tol=1e-6 if grad_dtype == torch.float32 else None)


def test_megatron_bias_swiglu_and_gelu_patterns(backend_name):
    """Megatron's MLP: ``bias_swiglu_impl(intermediate, bias)`` and ``bias_gelu_impl(intermediate, bias)``."""
    from apex.transformer.functional import bias_gelu, bias_swiglu, swiglu

    x = torch.randn(4, 2, 24, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    x64, b64 = x.detach().double().requires_grad_(), b.detach().double().requires_grad_()
    for ours, ref in ((bias_swiglu(x, b), F.silu((x64 + b64)[..., :12]) * (x64 + b64)[..., 12:]),
                      (bias_gelu(x, b), F.gelu(x64 + b64, approximate="tanh"))):
        dy = torch.randn(ours.shape)
        assert_rel_close(ours, ref, tol=1e-6)
        assert_rel_close(list(torch.autograd.grad(ours, (x, b), dy)),
                         list(torch.autograd.grad(ref, (x64, b64), dy.double())), tol=1e-6)
    assert_rel_close(swiglu(x), F.silu(x64[..., :12]) * x64[..., 12:], tol=1e-6)


# ------------------------------------------------------------------------------------------ torch.compile
def _block(x, wq, wk, wv, freqs, w1, b1, w2, b2):
    """An attention + MLP block: RoPE on q and k ([s, b, h, d]), softmax attention, bias-SwiGLU and
    bias-GELU MLPs."""
    from apex.transformer.functional import bias_gelu, bias_swiglu, fused_apply_rotary_pos_emb

    s, b, hidden = x.shape
    heads = 2
    q = (x @ wq).view(s, b, heads, -1)
    k = (x @ wk).view(s, b, heads, -1)
    v = (x @ wv).view(s, b, heads, -1)
    q = fused_apply_rotary_pos_emb(q, freqs)
    k = fused_apply_rotary_pos_emb(k, freqs, transpose_output_memory=True)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    attn = torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, -1), v).reshape(s, b, hidden)
    h = bias_swiglu(attn @ w1, b1)
    return bias_gelu(h @ w2, b2)


def test_compiled_block_fullgraph_matches_eager():
    torch.manual_seed(0)
    s, b, hidden = 5, 2, 16
    params = [torch.randn(hidden, hidden) * 0.3 for _ in range(3)] + [torch.rand(s, 1, 1, 6) * 3,
              torch.randn(hidden, 24) * 0.3, torch.randn(24), torch.randn(12, hidden) * 0.3, torch.randn(hidden)]
    x = torch.randn(s, b, hidden)

    def run(fn):
        leaves = [x.clone().requires_grad_()] + [p.clone().requires_grad_() if i != 3 else p
                                                for i, p in enumerate(params)]
        y = fn(*leaves)
        grads = torch.autograd.grad(y.square().sum(), [v for i, v in enumerate(leaves) if i != 4])
        return y, grads

    y_eager, g_eager = run(_block)
    compiled = torch.compile(_block, fullgraph=True)
    y_comp, g_comp = run(compiled)
    assert_rel_close(y_comp, y_eager.double(), tol=1e-6)
    assert_rel_close(list(g_comp), [g.double() for g in g_eager], tol=1e-5)


def test_compiled_wgrad_accumulation_fullgraph():
    from apex.transformer.functional import wgrad_gemm_accum_fp32

    def step(inp, go, mg):
        wgrad_gemm_accum_fp32(inp * 2, go, mg)
        return mg.sum()

    inp, go = torch.randn(7, 5), torch.randn(7, 3)
    mg_e, mg_c = torch.randn(3, 5), None
    mg_c = mg_e.clone()
    step(inp, go, mg_e)
    torch.compile(step, fullgraph=True, backend="aot_eager")(inp, go, mg_c)
    assert_rel_close(mg_c, mg_e.double(), tol=1e-6)
