"""apex.contrib.multihead_attn: both implementations against a float64 composition (outputs and every
gradient), the masks, Apex's packed-weight layout, and the argument checks."""

from __future__ import annotations

import pytest
import torch

from apex.contrib.multihead_attn import EncdecMultiheadAttn, SelfMultiheadAttn, fast_mask_softmax_dropout_func
from apex.testing import assert_rel_close

S, SK, B, E, H = 7, 5, 3, 32, 4


def _ref_attention(q_in, kv_in, wq, wk, wv, wo, bq, bk, bv, bo, mask, kind, additive=False):
    """Float64 attention written per head from separate q/k/v weights."""
    d = E // H
    q = (q_in @ wq.T + (bq if bq is not None else 0)).view(q_in.shape[0], B, H, d).permute(1, 2, 0, 3)
    k = (kv_in @ wk.T + (bk if bk is not None else 0)).view(kv_in.shape[0], B, H, d).permute(1, 2, 0, 3)
    v = (kv_in @ wv.T + (bv if bv is not None else 0)).view(kv_in.shape[0], B, H, d).permute(1, 2, 0, 3)
    s = q @ k.transpose(-1, -2) / d ** 0.5
    if kind == "pad":
        s = s + mask.view(B, 1, 1, -1) if additive else s.masked_fill(mask.bool().view(B, 1, 1, -1), float("-inf"))
    elif kind == "time":
        s = s.masked_fill(mask.bool(), float("-inf"))
    ctx = (torch.softmax(s, -1) @ v).permute(2, 0, 1, 3).reshape(q_in.shape[0], B, E)
    return ctx @ wo.T + (bo if bo is not None else 0)


def _qkv_from_packed(w, parts):
    """Apex's per-head [q, k, v] rows → separate (E, E) matrices."""
    return list(w.view(H, parts, E // H, *w.shape[1:]).transpose(0, 1).reshape(parts, E, *w.shape[1:]))


def _assert_grads(grads, ref_grads):
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        if r.norm() < 1e-9:  # the key bias: softmax is blind to it, its exact gradient is zero
            assert g.norm() < 1e-5, (i, g.norm())
        else:
            assert_rel_close(g, r, tol=1e-5, name=f"grad[{i}]")


def _mask(kind, sq, sk, additive=False):
    if kind == "pad":
        m = torch.zeros(B, sk, dtype=torch.bool)
        m[0, -2:] = True
        m[2, -1] = True
        return m.float() * -10000 if additive else m.to(torch.uint8)
    if kind == "time":
        return torch.triu(torch.ones(sq, sk, dtype=torch.uint8), 1)
    return None


@pytest.mark.parametrize("norm_add", [False, True])
@pytest.mark.parametrize("separate", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["none", "pad", "time", "additive"])
@pytest.mark.parametrize("impl", ["fast", "default"])
def test_self_attn_matches_float64(impl, kind, bias, separate, norm_add):
    if kind == "additive" and norm_add:
        pytest.skip("Apex has no additive mask with include_norm_add")
    layer = SelfMultiheadAttn(E, H, bias=bias, include_norm_add=norm_add, impl=impl, separate_qkv_params=separate,
                              mask_additive=kind == "additive")
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))  # non-trivial biases and norm parameters
    x = torch.randn(S, B, E, requires_grad=True)
    mask = _mask("pad" if kind == "additive" else kind, S, S, kind == "additive")
    kw = {"attn_mask": mask} if kind == "time" else {"key_padding_mask": mask}
    out, none = layer(x, x, x, is_training=False, **kw)
    assert none is None and out.shape == (S, B, E)
    dy = torch.randn_like(out)
    params = [p for p in layer.parameters()]
    grads = torch.autograd.grad(out, [x] + params, dy)

    p64 = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    x64 = x.detach().double().requires_grad_()
    if separate:
        wq, wk, wv = p64["q_weight"], p64["k_weight"], p64["v_weight"]
        bq, bk, bv = (p64["q_bias"], p64["k_bias"], p64["v_bias"]) if bias else (None,) * 3
    else:
        wq, wk, wv = _qkv_from_packed(p64["in_proj_weight"], 3)
        bq, bk, bv = _qkv_from_packed(p64["in_proj_bias"], 3) if bias else (None,) * 3
    h = x64
    if norm_add:
        g, b = ((p64["lyr_nrm_gamma_weights"], p64["lyr_nrm_beta_weights"]) if impl == "fast"
                else (p64["lyr_nrm.weight"], p64["lyr_nrm.bias"]))
        h = torch.nn.functional.layer_norm(x64, (E,), g, b, 1e-5)
    m64 = mask.double() if kind == "additive" else mask
    ref = _ref_attention(h, h, wq, wk, wv, p64["out_proj_weight"], bq, bk, bv, p64.get("out_proj_bias"), m64,
                         "pad" if kind == "additive" else kind, kind == "additive")
    if norm_add:
        ref = ref + x64
    ref_grads = torch.autograd.grad(ref, [x64] + [p64[n] for n, _ in layer.named_parameters()], dy.double())
    assert_rel_close(out, ref, tol=1e-5, name="out")
    _assert_grads(grads, ref_grads)


@pytest.mark.parametrize("kind", ["none", "pad", "time"])
@pytest.mark.parametrize("impl", ["fast", "default"])
def test_encdec_attn_matches_float64(impl, kind):
    layer = EncdecMultiheadAttn(E, H, bias=True, include_norm_add=True, impl=impl)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.1 * torch.randn_like(p))
    q = torch.randn(S, B, E, requires_grad=True)
    k = torch.randn(SK, B, E, requires_grad=True)
    mask = _mask(kind, S, SK)
    kw = {"attn_mask": mask} if kind == "time" else {"key_padding_mask": mask}
    out, _ = layer(q, k, k, is_training=False, **kw)
    dy = torch.randn_like(out)
    names = [n for n, _ in layer.named_parameters()]
    grads = torch.autograd.grad(out, [q, k] + list(layer.parameters()), dy)
    p64 = {n: p.detach().double().requires_grad_() for n, p in layer.named_parameters()}
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    wk, wv = _qkv_from_packed(p64["in_proj_weight_kv"], 2)
    bk, bv = _qkv_from_packed(p64["in_proj_bias_kv"], 2)
    g, b = ((p64["lyr_nrm_gamma_weights"], p64["lyr_nrm_beta_weights"]) if impl == "fast"
            else (p64["lyr_nrm.weight"], p64["lyr_nrm.bias"]))
    h = torch.nn.functional.layer_norm(q64, (E,), g, b, 1e-5)
    ref = _ref_attention(h, k64, p64["in_proj_weight_q"], wk, wv, p64["out_proj_weight"], p64["in_proj_bias_q"], bk,
                         bv, p64["out_proj_bias"], mask, kind) + q64
    ref_grads = torch.autograd.grad(ref, [q64, k64] + [p64[n] for n in names], dy.double())
    assert_rel_close(out, ref, tol=1e-5, name="out")
    _assert_grads(grads, ref_grads)


def test_fast_and_default_share_state_dicts_and_agree():
    torch.manual_seed(1)
    a = SelfMultiheadAttn(E, H, bias=True, impl="fast")
    b = SelfMultiheadAttn(E, H, bias=True, impl="default")
    b.load_state_dict(a.state_dict())
    x = torch.randn(S, B, E)
    assert_rel_close(a(x, x, x, is_training=False)[0], b(x, x, x, is_training=False)[0], tol=1e-6)
    assert set(a.state_dict()) == {"in_proj_weight", "in_proj_bias", "out_proj_weight", "out_proj_bias"}


@pytest.mark.parametrize("impl", ["fast", "default"])
def test_dropout_only_when_training(impl):
    layer = SelfMultiheadAttn(E, H, dropout=0.5, impl=impl)
    x = torch.randn(S, B, E)
    eval_a, eval_b = layer(x, x, x, is_training=False)[0], layer(x, x, x, is_training=False)[0]
    assert torch.equal(eval_a, eval_b)
    assert not torch.allclose(layer(x, x, x, is_training=True)[0], eval_a)


@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_fast_mask_softmax_dropout(dtype, additive):
    x = torch.randn(B * H, S, SK).to(dtype).requires_grad_()
    m = torch.zeros(B, SK, dtype=torch.bool)
    m[1, :2] = True
    mask = m.to(dtype) * -10000 if additive else m.to(torch.uint8)
    y = fast_mask_softmax_dropout_func(True, H, x, mask, additive, 0.0)
    dy = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, dy)
    x64 = x.detach().double().requires_grad_()
    s = x64.view(B, H, S, SK)
    s = s + mask.double().view(B, 1, 1, SK) if additive else s.masked_fill(m.view(B, 1, 1, SK), float("-inf"))
    ref = torch.softmax(s, -1).view(B * H, S, SK)
    (ref_dx,) = torch.autograd.grad(ref, x64, dy.double())
    # PyTorch in the same dtype is the baseline for half precision
    xs = x.detach().view(B, H, S, SK)
    xs = xs + mask.view(B, 1, 1, SK) if additive else xs.masked_fill(m.view(B, 1, 1, SK), float("-inf"))
    xb = xs.detach().requires_grad_()
    base = torch.softmax(xb, -1)
    (base_dx,) = torch.autograd.grad(base, xb, dy.view(B, H, S, SK))
    tol = 2e-6 if dtype == torch.float32 else None
    assert_rel_close(y, ref, dtype, tol=tol, baseline=base.reshape(B * H, S, SK))
    assert_rel_close(dx, ref_dx, dtype, tol=tol, baseline=base_dx.reshape(B * H, S, SK))


def test_compat_softmax_dropout_roundtrip():
    import fast_multihead_attn

    x = torch.randn(B * H, S, SK)
    pad = torch.zeros(B, SK, dtype=torch.uint8)
    pad[0, -1] = 1
    out, mask, probs = fast_multihead_attn.mask_softmax_dropout_forward(True, True, H, x, pad, 0.25)
    kept = mask.float().mean().item()
    assert 0.6 < kept < 0.9 and (probs.view(B, H, S, SK)[0, :, :, -1] == 0).all()
    assert torch.allclose(out, probs * mask / 0.75)
    dy = torch.randn_like(out)
    dx = fast_multihead_attn.mask_softmax_dropout_backward(True, H, dy, probs, mask, pad, 0.25)
    x64 = x.double().requires_grad_()
    s = x64.view(B, H, S, SK).masked_fill(pad.bool().view(B, 1, 1, SK), float("-inf"))
    ref = torch.softmax(s, -1).view(B * H, S, SK) * mask / 0.75
    (ref_dx,) = torch.autograd.grad(ref, x64, dy.double())
    assert_rel_close(dx, ref_dx, tol=1e-6)


@pytest.mark.parametrize("case", ["heads", "mask_shape", "both_masks", "impl", "query"])
def test_bad_input(case):
    with pytest.raises(ValueError):
        if case == "heads":
            SelfMultiheadAttn(30, 4)
        elif case == "impl":
            SelfMultiheadAttn(E, H, impl="cuda")
        else:
            layer = SelfMultiheadAttn(E, H)
            x = torch.randn(S, B, E)
            if case == "mask_shape":
                layer(x, x, x, key_padding_mask=torch.zeros(B, S + 1, dtype=torch.bool))
            elif case == "both_masks":
                layer(x, x, x, key_padding_mask=torch.zeros(B, S, dtype=torch.bool),
                      attn_mask=torch.zeros(S, S, dtype=torch.bool))
            else:
                layer(torch.randn(S, B, E + 1), x, x)
