"""Upstream's whole-block ``fast_multihead_attn`` entry points (``self_attn_forward``, ...), with Apex's
exact positional signatures and returned lists, computed with PyTorch operators.

Each ``*_forward`` returns the tensors Apex's CUDA extension returned (the ones upstream's
``fast_*_func.py`` autograd Functions save); the matching ``*_backward`` takes them back and returns
Apex's gradient list. See :mod:`apex.contrib.multihead_attn._fast_blocks_core` for the layouts, math and
dtype policy. Forward outputs carry no autograd history (upstream's are plain buffers too).
"""

from __future__ import annotations

import torch

from apex.contrib.multihead_attn import _fast_blocks_core as _core

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------- self_attn
def self_attn_forward(use_mask, use_time_mask, is_training, heads, inputs, input_weights, output_weights,
                      pad_mask, dropout_prob):
    """→ ``[input_lin_results, softmax_results, dropout_results, dropout_mask, matmul2_results, outputs]``."""
    lin, _, probs, dropped, dmask, m2, out = _core.self_forward(
        use_mask, use_time_mask, is_training, heads, inputs, input_weights, output_weights, None, None,
        pad_mask, dropout_prob, False)
    return [lin, probs, dropped, dmask, m2, out]


def self_attn_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results,
                       input_lin_results, inputs, input_weights, output_weights, dropout_mask, dropout_prob):
    """→ ``[input_grads, input_weight_grads, output_weight_grads]``."""
    grads = _core.self_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results,
                                input_lin_results, inputs, input_weights, output_weights, dropout_mask,
                                dropout_prob)
    return list(grads[:3])


def self_attn_bias_forward(use_mask, use_time_mask, is_training, heads, inputs, input_weights, output_weights,
                           input_biases, output_biases, pad_mask, dropout_prob):
    """As :func:`self_attn_forward` with the input and output projection biases."""
    lin, _, probs, dropped, dmask, m2, out = _core.self_forward(
        use_mask, use_time_mask, is_training, heads, inputs, input_weights, output_weights, input_biases,
        output_biases, pad_mask, dropout_prob, False)
    return [lin, probs, dropped, dmask, m2, out]


def self_attn_bias_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results,
                            input_lin_results, inputs, input_weights, output_weights, dropout_mask,
                            dropout_prob):
    """→ ``[input_grads, input_weight_grads, output_weight_grads, input_bias_grads, output_bias_grads]``."""
    return list(_core.self_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results,
                                    input_lin_results, inputs, input_weights, output_weights, dropout_mask,
                                    dropout_prob))


def _check_additive(use_mask, pad_mask) -> None:
    if use_mask and isinstance(pad_mask, Tensor) and not pad_mask.is_floating_point():
        raise TypeError(f"pad_mask of the additive-mask block must be a floating-point (additive) mask, "
                        f"got {pad_mask.dtype}")


def self_attn_bias_additive_mask_forward(use_mask, use_time_mask, is_training, heads, inputs, input_weights,
                                         output_weights, input_biases, output_biases, pad_mask, dropout_prob):
    """Self-attention with biases and a float ``pad_mask`` (batch, k_len) added to the scaled scores →
    ``[input_lin_results, bmm1_results, dropout_results, dropout_mask, matmul2_results, outputs]``
    (``bmm1_results``: the scaled scores before the mask; the backward recomputes the softmax from them).
    """
    _check_additive(use_mask, pad_mask)
    lin, bmm1, _, dropped, dmask, m2, out = _core.self_forward(
        use_mask, use_time_mask, is_training, heads, inputs, input_weights, output_weights, input_biases,
        output_biases, pad_mask, dropout_prob, True)
    return [lin, bmm1, dropped, dmask, m2, out]


def self_attn_bias_additive_mask_backward(heads, output_grads, matmul2_results, dropout_results, bmm1_results,
                                          pad_mask, input_lin_results, inputs, input_weights, output_weights,
                                          dropout_mask, dropout_prob):
    """→ ``[input_grads, input_weight_grads, output_weight_grads, input_bias_grads, output_bias_grads]``."""
    _core._check_tensor(bmm1_results, "bmm1_results", 3)
    _core._check_tensor(inputs, "inputs", 3)
    use_mask = isinstance(pad_mask, Tensor) and pad_mask.numel() > 0
    _check_additive(use_mask, pad_mask)
    S, B, _ = inputs.shape
    mask = _core._check_mask(use_mask, False, pad_mask, B, S, S)
    with torch.no_grad():
        probs = _core._softmax(_core._mask_scores(bmm1_results, mask, False, True, B))
    return list(_core.self_backward(heads, output_grads, matmul2_results, dropout_results, probs,
                                    input_lin_results, inputs, input_weights, output_weights, dropout_mask,
                                    dropout_prob))


def self_attn_norm_add_forward(use_mask, use_time_mask, is_training, heads, inputs, lyr_nrm_gamma_weights,
                               lyr_nrm_beta_weights, input_weights, output_weights, pad_mask, dropout_prob):
    """``inputs + dropout(self_attn(layer_norm(inputs)))`` → ``[lyr_nrm_results, lyr_nrm_mean,
    lyr_nrm_invvar, input_lin_results, softmax_results, dropout_results, dropout_mask, matmul2_results,
    dropout_add_mask, outputs]``."""
    ln, mean, invvar = _core.norm_forward(inputs, lyr_nrm_gamma_weights, lyr_nrm_beta_weights)
    lin, _, probs, dropped, dmask, m2, y = _core.self_forward(
        use_mask, use_time_mask, is_training, heads, ln, input_weights, output_weights, None, None, pad_mask,
        dropout_prob, False)
    add_mask, out = _core.dropout_add_forward(y, inputs, is_training, dropout_prob)
    return [ln, mean, invvar, lin, probs, dropped, dmask, m2, add_mask, out]


def self_attn_norm_add_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results,
                                input_lin_results, lyr_nrm_results, lyr_nrm_mean, lyr_nrm_invvar, inputs,
                                lyr_nrm_gamma_weights, lyr_nrm_beta_weights, input_weights, output_weights,
                                dropout_mask, dropout_add_mask, dropout_prob):
    """→ ``[input_grads, lyr_nrm_gamma_grads, lyr_nrm_beta_grads, input_weight_grads, output_weight_grads]``."""
    g = _core.dropout_add_backward(output_grads, dropout_add_mask, dropout_prob)
    ln_grads, iw_grad, ow_grad, _, _ = _core.self_backward(
        heads, g, matmul2_results, dropout_results, softmax_results, input_lin_results, lyr_nrm_results,
        input_weights, output_weights, dropout_mask, dropout_prob)
    x_grad, gamma_grad, beta_grad = _core.norm_add_backward(ln_grads, output_grads, inputs, lyr_nrm_mean,
                                                            lyr_nrm_invvar, lyr_nrm_gamma_weights)
    return [x_grad, gamma_grad, beta_grad, iw_grad, ow_grad]


# -------------------------------------------------------------------------------------- encdec_attn
def encdec_multihead_attn_forward(use_mask, use_time_mask, is_training, heads, inputs_q, inputs_kv,
                                  input_weights_q, input_weights_kv, output_weights, pad_mask, dropout_prob):
    """→ ``[input_lin_q_results, input_lin_kv_results, softmax_results, dropout_results, dropout_mask,
    matmul2_results, outputs]``."""
    return list(_core.encdec_forward(use_mask, use_time_mask, is_training, heads, inputs_q, inputs_kv,
                                     input_weights_q, input_weights_kv, output_weights, pad_mask, dropout_prob))


def encdec_multihead_attn_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results,
                                   input_lin_q_results, input_lin_kv_results, inputs_q, inputs_kv,
                                   input_weights_q, input_weights_kv, output_weights, dropout_mask,
                                   dropout_prob):
    """→ ``[input_q_grads, input_kv_grads, input_weight_q_grads, input_weight_kv_grads,
    output_weight_grads]``."""
    return list(_core.encdec_backward(heads, output_grads, matmul2_results, dropout_results, softmax_results,
                                      input_lin_q_results, input_lin_kv_results, inputs_q, inputs_kv,
                                      input_weights_q, input_weights_kv, output_weights, dropout_mask,
                                      dropout_prob))


def encdec_multihead_attn_norm_add_forward(use_mask, use_time_mask, is_training, heads, inputs_q, inputs_kv,
                                           lyr_nrm_gamma_weights, lyr_nrm_beta_weights, input_weights_q,
                                           input_weights_kv, output_weights, pad_mask, dropout_prob):
    """``inputs_q + dropout(encdec_attn(layer_norm(inputs_q), inputs_kv))`` → ``[lyr_nrm_results,
    lyr_nrm_mean, lyr_nrm_invvar, input_lin_q_results, input_lin_kv_results, softmax_results, dropout_results,
    dropout_mask, matmul2_results, dropout_add_mask, outputs]``."""
    ln, mean, invvar = _core.norm_forward(inputs_q, lyr_nrm_gamma_weights, lyr_nrm_beta_weights)
    lin_q, lin_kv, probs, dropped, dmask, m2, y = _core.encdec_forward(
        use_mask, use_time_mask, is_training, heads, ln, inputs_kv, input_weights_q, input_weights_kv,
        output_weights, pad_mask, dropout_prob)
    add_mask, out = _core.dropout_add_forward(y, inputs_q, is_training, dropout_prob)
    return [ln, mean, invvar, lin_q, lin_kv, probs, dropped, dmask, m2, add_mask, out]


def encdec_multihead_attn_norm_add_backward(heads, output_grads, matmul2_results, dropout_results,
                                            softmax_results, input_lin_q_results, input_lin_kv_results,
                                            lyr_nrm_results, lyr_nrm_mean, lyr_nrm_invvar, inputs_q, inputs_kv,
                                            lyr_nrm_gamma_weights, lyr_nrm_beta_weights, input_weights_q,
                                            input_weights_kv, output_weights, dropout_mask, dropout_add_mask,
                                            dropout_prob):
    """→ ``[input_q_grads, input_kv_grads, lyr_nrm_gamma_grads, lyr_nrm_beta_grads, input_weight_q_grads,
    input_weight_kv_grads, output_weight_grads]``."""
    g = _core.dropout_add_backward(output_grads, dropout_add_mask, dropout_prob)
    ln_grads, xkv_grad, wq_grad, wkv_grad, ow_grad = _core.encdec_backward(
        heads, g, matmul2_results, dropout_results, softmax_results, input_lin_q_results, input_lin_kv_results,
        lyr_nrm_results, inputs_kv, input_weights_q, input_weights_kv, output_weights, dropout_mask,
        dropout_prob)
    xq_grad, gamma_grad, beta_grad = _core.norm_add_backward(ln_grads, output_grads, inputs_q, lyr_nrm_mean,
                                                             lyr_nrm_invvar, lyr_nrm_gamma_weights)
    return [xq_grad, xkv_grad, gamma_grad, beta_grad, wq_grad, wkv_grad, ow_grad]
