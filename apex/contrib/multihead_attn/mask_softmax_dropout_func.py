"""``fast_mask_softmax_dropout_func``: masked softmax and dropout over attention scores.

``inputs`` (batch·heads, tgt_len, src_len); ``pad_mask`` (batch, src_len) is boolean/byte (nonzero = masked,
filled with −inf) or, with ``mask_additive``, a float mask added to the scores. Returns
``dropout(softmax(inputs + mask))`` with dropout applied only when ``is_training``. Computed in the input
dtype with PyTorch's softmax (fp32 accumulation inside).

The ``fast_multihead_attn`` compatibility functions (``mask_softmax_dropout_forward`` / ``_backward`` and
the additive variants) take Apex's positional arguments and return its ``[dropout_results, dropout_mask,
softmax_results]``.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _masked_scores(heads: int, inputs: Tensor, pad_mask: Tensor | None, additive: bool) -> Tensor:
    if inputs.dim() != 3 or inputs.shape[0] % heads:
        raise ValueError(f"inputs must be (batch*heads, tgt_len, src_len) with heads={heads}, "
                         f"got {tuple(inputs.shape)}")
    if pad_mask is None:
        return inputs
    BH, Sq, Sk = inputs.shape
    B = BH // heads
    if tuple(pad_mask.shape) != (B, Sk):
        raise ValueError(f"pad_mask must have shape {(B, Sk)}, got {tuple(pad_mask.shape)}")
    x = inputs.view(B, heads, Sq, Sk)
    if additive:
        x = x + pad_mask.to(inputs.dtype).view(B, 1, 1, Sk)
    else:
        x = x.masked_fill(pad_mask.to(torch.bool).view(B, 1, 1, Sk), float("-inf"))
    return x.view(BH, Sq, Sk)


def fast_mask_softmax_dropout_func(is_training: bool, heads: int, inputs: Tensor, pad_mask: Tensor | None,
                                   mask_additive: bool, dropout_prob: float) -> Tensor:
    """``dropout(softmax(inputs + mask, dim=-1))``; see the module docstring for the mask conventions."""
    probs = torch.softmax(_masked_scores(heads, inputs, pad_mask, mask_additive), dim=-1)
    return torch.nn.functional.dropout(probs, p=dropout_prob, training=bool(is_training) and dropout_prob > 0)


# -------------------------------------------------------------------- compat: fast_multihead_attn.*
def _forward(use_mask, is_training, heads, inputs, pad_mask, dropout_prob, additive):
    with torch.no_grad():
        probs = torch.softmax(_masked_scores(int(heads), inputs, pad_mask if use_mask else None, additive), -1)
        if is_training and dropout_prob > 0:
            keep = torch.rand_like(probs, dtype=torch.float32) >= dropout_prob
            out = probs * keep / (1.0 - dropout_prob)
            mask = keep.to(torch.uint8)
        else:
            out, mask = probs, torch.ones_like(probs, dtype=torch.uint8)
    return [out, mask, probs]


def _backward(output_grads, softmax_results, dropout_mask, dropout_prob):
    g = output_grads.float()
    if dropout_prob > 0:
        g = g * dropout_mask / (1.0 - dropout_prob)
    p = softmax_results.float()
    return (p * (g - (g * p).sum(-1, keepdim=True))).to(output_grads.dtype)


def mask_softmax_dropout_forward(use_mask, is_training, heads, input, pad_mask, dropout_prob):  # noqa: A002
    """Upstream's ``fast_multihead_attn.mask_softmax_dropout_forward``: softmax of ``input`` with the
    boolean padding mask (True = masked) applied when ``use_mask``, then dropout when ``is_training``.
    Returns ``[dropout_results, dropout_mask, softmax_results]``; softmax in fp32, outputs in the input dtype.
    """
    return _forward(use_mask, is_training, heads, input, pad_mask, float(dropout_prob), False)


def mask_softmax_dropout_backward(use_mask, heads, output_grads, softmax_results, dropout_mask, padding_mask,
                                  dropout_prob):
    """Upstream's ``fast_multihead_attn.mask_softmax_dropout_backward``: the gradient of the scores
    from the saved softmax results and dropout mask.
    """
    return _backward(output_grads, softmax_results, dropout_mask, float(dropout_prob))


def additive_mask_softmax_dropout_forward(use_mask, is_training, heads, input, pad_mask,  # noqa: A002
                                          dropout_prob):
    """As :func:`mask_softmax_dropout_forward`, with ``pad_mask`` added to the scores (an additive mask,
    ``-inf`` = masked) instead of a boolean one.
    """
    return _forward(use_mask, is_training, heads, input, pad_mask, float(dropout_prob), True)


def additive_mask_softmax_dropout_backward(use_mask, heads, output_grads, softmax_results, dropout_mask,
                                           dropout_prob):
    """The backward of :func:`additive_mask_softmax_dropout_forward`."""
    return _backward(output_grads, softmax_results, dropout_mask, float(dropout_prob))
