"""The computation behind :mod:`apex.contrib.multihead_attn._fast_blocks` (upstream's whole-block
``fast_multihead_attn`` entry points), on PyTorch operators.

Each ``*_forward`` takes Apex's positional arguments and returns Apex's list of saved tensors (same order,
shapes and roles); the matching ``*_backward`` takes those tensors back and returns Apex's gradient list.
Layouts (Apex's): inputs ``[seq, batch, embed]``; the packed input projection ``input_lin_results``
``(seq, batch, 3·embed)`` is grouped per head ``[h0 q, h0 k, h0 v, h1 q, ...]`` (encoder-decoder: q alone,
kv ``[h0 k, h0 v, ...]``); attention batches are ordered ``batch·heads + head``; ``softmax_results``,
``dropout_results`` and ``dropout_mask`` are ``(batch·heads, q_len, k_len)``; ``matmul2_results`` is
``(q_len, batch·heads, head_dim)``.

Math: ``scores = (q kᵀ)/√head_dim``, masked (byte ``pad_mask`` (batch, k_len) or, with ``use_time_mask``,
(q_len, k_len), nonzero = −inf; or a float mask added to the scores in the ``additive_mask`` block),
``softmax`` in fp32 rounded to the input dtype, dropout with a saved uint8 keep-mask scaled by 1/(1−p),
``matmul2 = dropout · v``, ``outputs = matmul2 Wₒᵀ (+ bₒ)``. ``norm_add`` blocks apply a LayerNorm (eps 1e-5,
fp32 statistics saved as ``lyr_nrm_mean``/``lyr_nrm_invvar`` of shape (seq·batch,)) to the (query) input
first and end with ``inputs + dropout(outputs)`` (``dropout_add_mask``).

Dtype policy: every activation in the input dtype (fp32, fp16 or bf16; upstream allows fp16 only), matmuls
accumulate in fp32 (PyTorch's), softmax and LayerNorm statistics in fp32. Outside training the dropout masks
are all ones and ``dropout_results`` equals ``softmax_results`` (upstream leaves them uninitialised); the
backward always applies the masks with the 1/(1−p) scale, as upstream does, so only call it after a
training forward (or with ``dropout_prob=0``).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor
_EPS = 1e-5


# ------------------------------------------------------------------------------------------ checks
def _check_tensor(t, name: str, dim: int) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be a {dim}-D tensor, got shape {tuple(t.shape)}")


def _check_float(t: Tensor, name: str) -> None:
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")


def _heads(heads, embed_dim: int) -> int:
    h = int(heads.item() if isinstance(heads, Tensor) else heads)
    if h <= 0 or embed_dim % h:
        raise ValueError(f"heads must be a positive divisor of the embedding size {embed_dim}, got {h}")
    return h


def _prob(dropout_prob) -> float:
    p = float(dropout_prob.item() if isinstance(dropout_prob, Tensor) else dropout_prob)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_prob must be in [0, 1), got {p}")
    return p


def _check_weight(w, name: str, shape: tuple[int, ...]) -> None:
    _check_tensor(w, name, len(shape))
    if tuple(w.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(w.shape)}")


def _check_mask(use_mask: bool, use_time_mask: bool, pad_mask, B: int, Sq: int, Sk: int) -> Tensor | None:
    if not use_mask:
        return None
    _check_tensor(pad_mask, "pad_mask", 2)
    shape = (Sq, Sk) if use_time_mask else (B, Sk)
    if tuple(pad_mask.shape) != shape:
        kind = "(q_len, k_len) with use_time_mask" if use_time_mask else "(batch, k_len)"
        raise ValueError(f"pad_mask must be {kind} = {shape}, got {tuple(pad_mask.shape)}")
    return pad_mask


# ------------------------------------------------------------------------------------ attention core
def _split(lin: Tensor, heads: int, parts: int) -> list[Tensor]:
    """(S, B, parts·E) grouped per head → ``parts`` views of (B·heads, S, head_dim)."""
    S, B, width = lin.shape
    d = width // (parts * heads)
    x = lin.reshape(S, B * heads, parts, d).permute(2, 1, 0, 3)
    return list(x.unbind(0))


def _merge(parts: list[Tensor], S: int, B: int) -> Tensor:
    """Inverse of :func:`_split`: ``parts`` tensors of (B·heads, S, head_dim) → (S, B, parts·E)."""
    return torch.stack(parts, 0).permute(2, 1, 0, 3).reshape(S, B, -1)


def _mask_scores(scores: Tensor, mask: Tensor | None, use_time_mask: bool, additive: bool, B: int) -> Tensor:
    if mask is None:
        return scores
    BH, Sq, Sk = scores.shape
    x = scores.view(B, BH // B, Sq, Sk)
    m = mask.view(1, 1, Sq, Sk) if use_time_mask else mask.view(B, 1, 1, Sk)
    x = x + m.to(x.dtype) if additive else x.masked_fill(m.to(torch.bool), float("-inf"))
    return x.view(BH, Sq, Sk)


def _softmax(scores: Tensor) -> Tensor:
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def _attn_forward(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, use_time_mask: bool, additive: bool,
                  is_training: bool, p: float, B: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``bmm1_results, softmax_results, dropout_results, dropout_mask, matmul2_results``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    bmm1 = torch.baddbmm(q.new_empty(()), q, k.transpose(1, 2), beta=0.0, alpha=scale)
    probs = _softmax(_mask_scores(bmm1, mask, use_time_mask, additive, B))
    if is_training:
        keep = torch.rand(probs.shape, device=probs.device) >= p
        dropped = probs * keep * (1.0 / (1.0 - p)) if p > 0 else probs.clone()
    else:
        keep, dropped = torch.ones_like(probs, dtype=torch.bool), probs.clone()
    matmul2 = torch.bmm(dropped, v).transpose(0, 1).contiguous()
    return bmm1, probs, dropped, keep.to(torch.uint8), matmul2


def _attn_backward(grad_ctx: Tensor, q: Tensor, k: Tensor, v: Tensor, dropout_results: Tensor,
                   softmax_results: Tensor, dropout_mask: Tensor, p: float) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of q, k, v (each (B·heads, S, head_dim)) given that of the attention context."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    grad_v = torch.bmm(dropout_results.transpose(1, 2), grad_ctx)
    g = torch.bmm(grad_ctx, v.transpose(1, 2)).float() * dropout_mask * (1.0 / (1.0 - p))
    s = softmax_results.float()
    gs = (s * (g - (g * s).sum(-1, keepdim=True))).to(q.dtype)
    grad_q = torch.bmm(gs, k) * scale
    grad_k = torch.bmm(gs.transpose(1, 2), q) * scale
    return grad_q, grad_k, grad_v


def _out_backward(output_grads: Tensor, matmul2_results: Tensor, output_weights: Tensor, heads: int):
    """Output projection backward → (grad of the context as (B·heads, Sq, d), weight grad, bias grad)."""
    Sq, B, E = output_grads.shape
    g2 = output_grads.reshape(-1, E)
    w_grad = g2.t().mm(matmul2_results.reshape(-1, E))
    b_grad = g2.sum(0)
    grad_ctx = g2.mm(output_weights).view(Sq, B * heads, E // heads).transpose(0, 1)
    return grad_ctx, w_grad, b_grad


def _lin_backward(lin_grads: Tensor, inputs: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """y = x Wᵀ (+ b) backward: (grad x, grad W, grad b)."""
    g2 = lin_grads.reshape(-1, lin_grads.shape[-1])
    return (g2.mm(weights).view(inputs.shape), g2.t().mm(inputs.reshape(-1, inputs.shape[-1])), g2.sum(0))


# ------------------------------------------------------------------------------- norm / dropout-add
def _layer_norm(x: Tensor, gamma: Tensor, beta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """PyTorch's fused layer norm in fp32 (``torch.native_layer_norm``); ``mean`` and ``invvar`` are one fp32
    value per row, as Apex's kernel returns them."""
    E = x.shape[-1]
    y, mean, invvar = torch.native_layer_norm(x.float().reshape(-1, E), [E], gamma.float(), beta.float(), _EPS)
    return y.to(x.dtype).view(x.shape), mean.view(-1), invvar.view(-1)


def _layer_norm_backward(dy: Tensor, x: Tensor, mean: Tensor, invvar: Tensor, gamma: Tensor):
    """PyTorch's fused layer-norm backward in fp32 (``aten.native_layer_norm_backward``)."""
    E = x.shape[-1]
    dy32 = dy.float().reshape(-1, E)
    dx, dg, _ = torch.ops.aten.native_layer_norm_backward(dy32, x.float().reshape(-1, E), [E], mean.view(-1, 1),
                                                          invvar.view(-1, 1), gamma.float(), None,
                                                          [True, True, False])
    return dx.view(x.shape), dg.to(gamma.dtype), dy32.sum(0).to(gamma.dtype)


def _dropout_add(y: Tensor, residual: Tensor, is_training: bool, p: float) -> tuple[Tensor, Tensor]:
    if not is_training:
        return torch.ones_like(y, dtype=torch.uint8), y + residual
    keep = torch.rand(y.shape, device=y.device) >= p
    return keep.to(torch.uint8), (y.float() * keep * (1.0 / (1.0 - p)) + residual.float()).to(y.dtype)


# ------------------------------------------------------------------------------------- block drivers
def self_forward(use_mask, use_time_mask, is_training, heads, inputs, input_weights, output_weights,
                 input_biases, output_biases, pad_mask, dropout_prob, additive):
    """Self-attention block; returns ``input_lin, bmm1, softmax, dropout, dropout_mask, matmul2, outputs``."""
    _check_tensor(inputs, "inputs", 3)
    _check_float(inputs, "inputs")
    S, B, E = inputs.shape
    h, p = _heads(heads, E), _prob(dropout_prob)
    _check_weight(input_weights, "input_weights", (3 * E, E))
    _check_weight(output_weights, "output_weights", (E, E))
    if input_biases is not None:
        _check_weight(input_biases, "input_biases", (3 * E,))
        _check_weight(output_biases, "output_biases", (E,))
    if additive and use_mask and use_time_mask:
        raise ValueError("the additive-mask block supports a padding mask only (use_time_mask must be False)")
    mask = _check_mask(bool(use_mask), bool(use_time_mask), pad_mask, B, S, S)
    with torch.no_grad():
        lin = torch.nn.functional.linear(inputs, input_weights, input_biases)
        q, k, v = _split(lin, h, 3)
        bmm1, probs, dropped, dmask, m2 = _attn_forward(q, k, v, mask, bool(use_time_mask), additive,
                                                        bool(is_training), p, B)
        out = torch.nn.functional.linear(m2.view(S, B, E), output_weights, output_biases)
    return lin, bmm1, probs, dropped, dmask, m2, out


def self_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results, input_lin_results,
                  inputs, input_weights, output_weights, dropout_mask, dropout_prob):
    """Self-attention block backward → ``input_grads, input_weight_grads, output_weight_grads,
    input_bias_grads, output_bias_grads``."""
    _check_tensor(output_grads, "output_grads", 3)
    _check_tensor(inputs, "inputs", 3)
    S, B, E = inputs.shape
    h, p = _heads(heads, E), _prob(dropout_prob)
    if output_grads.shape != inputs.shape:
        raise ValueError(f"output_grads must have the shape of inputs {tuple(inputs.shape)}, "
                         f"got {tuple(output_grads.shape)}")
    with torch.no_grad():
        grad_ctx, ow_grad, ob_grad = _out_backward(output_grads, matmul2_results, output_weights, h)
        q, k, v = _split(input_lin_results, h, 3)
        gq, gk, gv = _attn_backward(grad_ctx, q, k, v, dropout_results, softmax_results, dropout_mask, p)
        x_grad, iw_grad, ib_grad = _lin_backward(_merge([gq, gk, gv], S, B), inputs, input_weights)
    return x_grad, iw_grad, ow_grad, ib_grad, ob_grad


def encdec_forward(use_mask, use_time_mask, is_training, heads, inputs_q, inputs_kv, input_weights_q,
                   input_weights_kv, output_weights, pad_mask, dropout_prob):
    """Encoder-decoder block; returns ``input_lin_q, input_lin_kv, softmax, dropout, dropout_mask, matmul2,
    outputs``."""
    _check_tensor(inputs_q, "inputs_q", 3)
    _check_tensor(inputs_kv, "inputs_kv", 3)
    _check_float(inputs_q, "inputs_q")
    Sq, B, E = inputs_q.shape
    Sk = inputs_kv.shape[0]
    if inputs_kv.shape[1:] != inputs_q.shape[1:]:
        raise ValueError(f"inputs_kv must be [k_len, {B}, {E}] like inputs_q, got {tuple(inputs_kv.shape)}")
    h, p = _heads(heads, E), _prob(dropout_prob)
    _check_weight(input_weights_q, "input_weights_q", (E, E))
    _check_weight(input_weights_kv, "input_weights_kv", (2 * E, E))
    _check_weight(output_weights, "output_weights", (E, E))
    mask = _check_mask(bool(use_mask), bool(use_time_mask), pad_mask, B, Sq, Sk)
    with torch.no_grad():
        lin_q = torch.nn.functional.linear(inputs_q, input_weights_q)
        lin_kv = torch.nn.functional.linear(inputs_kv, input_weights_kv)
        (q,), (k, v) = _split(lin_q, h, 1), _split(lin_kv, h, 2)
        _, probs, dropped, dmask, m2 = _attn_forward(q, k, v, mask, bool(use_time_mask), False,
                                                     bool(is_training), p, B)
        out = torch.nn.functional.linear(m2.view(Sq, B, E), output_weights)
    return lin_q, lin_kv, probs, dropped, dmask, m2, out


def encdec_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results, input_lin_q_results,
                    input_lin_kv_results, inputs_q, inputs_kv, input_weights_q, input_weights_kv, output_weights,
                    dropout_mask, dropout_prob):
    """Encoder-decoder block backward → ``input_q_grads, input_kv_grads, input_weight_q_grads,
    input_weight_kv_grads, output_weight_grads``."""
    _check_tensor(output_grads, "output_grads", 3)
    _check_tensor(inputs_q, "inputs_q", 3)
    _check_tensor(inputs_kv, "inputs_kv", 3)
    Sq, B, E = inputs_q.shape
    h, p = _heads(heads, E), _prob(dropout_prob)
    if output_grads.shape != inputs_q.shape:
        raise ValueError(f"output_grads must have the shape of inputs_q {tuple(inputs_q.shape)}, "
                         f"got {tuple(output_grads.shape)}")
    with torch.no_grad():
        grad_ctx, ow_grad, _ = _out_backward(output_grads, matmul2_results, output_weights, h)
        (q,), (k, v) = _split(input_lin_q_results, h, 1), _split(input_lin_kv_results, h, 2)
        gq, gk, gv = _attn_backward(grad_ctx, q, k, v, dropout_results, softmax_results, dropout_mask, p)
        xq_grad, wq_grad, _ = _lin_backward(_merge([gq], Sq, B), inputs_q, input_weights_q)
        xkv_grad, wkv_grad, _ = _lin_backward(_merge([gk, gv], inputs_kv.shape[0], B), inputs_kv,
                                              input_weights_kv)
    return xq_grad, xkv_grad, wq_grad, wkv_grad, ow_grad


def norm_forward(inputs: Tensor, gamma, beta) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm of the block input → ``lyr_nrm_results, lyr_nrm_mean, lyr_nrm_invvar``."""
    _check_tensor(inputs, "inputs", 3)
    _check_float(inputs, "inputs")
    E = inputs.shape[-1]
    _check_weight(gamma, "lyr_nrm_gamma_weights", (E,))
    _check_weight(beta, "lyr_nrm_beta_weights", (E,))
    with torch.no_grad():
        return _layer_norm(inputs, gamma, beta)


def dropout_add_forward(y: Tensor, residual: Tensor, is_training, dropout_prob) -> tuple[Tensor, Tensor]:
    """``residual + dropout(y)`` → ``dropout_add_mask, outputs``."""
    with torch.no_grad():
        return _dropout_add(y, residual, bool(is_training), _prob(dropout_prob))


def dropout_add_backward(output_grads: Tensor, dropout_add_mask: Tensor, dropout_prob) -> Tensor:
    _check_tensor(output_grads, "output_grads", 3)
    if dropout_add_mask.shape != output_grads.shape:
        raise ValueError(f"dropout_add_mask must have shape {tuple(output_grads.shape)}, "
                         f"got {tuple(dropout_add_mask.shape)}")
    p = _prob(dropout_prob)
    with torch.no_grad():
        return (output_grads.float() * dropout_add_mask * (1.0 / (1.0 - p))).to(output_grads.dtype)


def norm_add_backward(ln_grads: Tensor, output_grads: Tensor, inputs: Tensor, mean: Tensor, invvar: Tensor,
                      gamma: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """LayerNorm backward plus the residual path → ``input_grads, gamma_grads, beta_grads``."""
    with torch.no_grad():
        dx, dg, db = _layer_norm_backward(ln_grads, inputs, mean, invvar, gamma)
        return (dx + output_grads.float()).to(inputs.dtype), dg, db
