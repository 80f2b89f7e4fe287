"""apex.contrib.fmha: packed variable-length attention against per-sequence float64 attention (context and
QKV gradient), the fmhalib compatibility functions (with dropout), and the argument checks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from apex.contrib.fmha import FMHA, FMHAFun
from apex.contrib.fmha import fmha as M
from apex.testing import assert_rel_close

H, D = 3, 8
LENS = [5, 1, 7, 3]


def _packed(dtype=torch.float32):
    cu = torch.tensor([0] + LENS, dtype=torch.int32).cumsum(0).to(torch.int32)
    qkv = torch.randn(int(cu[-1]), 3, H, D).to(dtype).requires_grad_()
    return qkv, cu


def _ref(qkv, cu, keep=None, p=0.0):
    """Float64 attention of each sequence on its own; ``keep`` (b, h, s, s) drop pattern (padded)."""
    out = []
    for i in range(len(cu) - 1):
        x = qkv[int(cu[i]):int(cu[i + 1])].double()
        q, k, v = (x[:, j].transpose(0, 1) for j in range(3))  # (h, s, d)
        pr = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D), -1)
        if keep is not None:
            n = x.shape[0]
            pr = pr * keep[i, :, :n, :n] / (1 - p)
        out.append((pr @ v).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fmha_matches_float64(dtype):
    qkv, cu = _packed(dtype)
    ctx = FMHAFun.apply(qkv, cu, 0.0, 8, True, False)
    assert ctx.shape == (qkv.shape[0], H, D) and ctx.dtype == dtype
    dy = torch.randn_like(ctx)
    (g,) = torch.autograd.grad(ctx, qkv, dy)
    q64 = qkv.detach().double().requires_grad_()
    ref = _ref(q64, cu)
    (rg,) = torch.autograd.grad(ref, q64, dy.double())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_rel_close(ctx, ref, tol=tol)
    assert_rel_close(g, rg, tol=tol)


def test_module_packs_hidden():
    cfg = SimpleNamespace(attention_probs_dropout_prob=0.0, num_attention_heads=H, hidden_size=H * D)
    qkv, cu = _packed()
    out = FMHA(cfg)(qkv.detach().reshape(-1, 3 * H * D), cu, 7, is_training=False)
    assert_rel_close(out, _ref(qkv, cu).reshape(-1, H * D), tol=1e-5)


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_compat_fwd_bwd(p):
    import fmhalib

    qkv, cu = _packed()
    ctx, smask = fmhalib.fwd(qkv.detach(), cu, p, 8, True, False, False, None)
    assert smask.shape == (4, H, 8, 8)
    keep = (smask >= 0).double() if p > 0 else None
    q64 = qkv.detach().double().requires_grad_()
    ref = _ref(q64, cu, keep, p)
    assert_rel_close(ctx, ref, tol=1e-5)
    dy = torch.randn_like(ctx)
    dqkv, _ = fmhalib.bwd(dy, qkv.detach(), smask, cu, p, 8, False)
    (rg,) = torch.autograd.grad(ref, q64, dy.double())
    assert_rel_close(dqkv, rg, tol=1e-5)
    assert len(fmhalib.bwd_nl(dy, qkv.detach(), smask, cu, p, 8, False)) == 3


@pytest.mark.parametrize("case", ["shape", "cu_end", "max_s", "empty"])
def test_bad_input(case):
    qkv, cu = _packed()
    with pytest.raises(ValueError):
        if case == "shape":
            M.fmha(qkv[:, :2], cu, 0.0, 8)
        elif case == "cu_end":
            M.fmha(qkv, cu + 1, 0.0, 8)
        elif case == "max_s":
            M.fmha(qkv, cu, 0.0, 4)
        else:
            M.fmha(qkv, torch.tensor([0, 0, 16], dtype=torch.int32), 0.0, 16)
