"""Apex's ``mlp_cuda`` entry points on top of :mod:`apex.ops.fused_dense`'s dense chains.

``forward(use_bias, activation, inputs)`` with ``inputs = [x, W₀ … W_{L−1}, b₀ … b_{L−1}]`` (biases only
when ``use_bias``) returns ``[output, reserved_space]``; ``reserved_space`` is a flat tensor holding every
layer's activation output (what the backward needs), as Apex's. ``backward(use_bias, activation, grad_o,
fprop_outputs, inputs)`` returns the gradients of ``inputs``, in order. Activation codes: 0 none, 1 ReLU,
2 sigmoid, applied after every layer. ``x`` must be 2-D ``[batch, features]``.
"""

from __future__ import annotations

import torch

from apex.ops._norm import check_devices
from apex.ops.fused_dense import _use_triton, chain_backward, chain_forward, check_chain

Tensor = torch.Tensor


def _split(use_bias, activation, inputs):
    if activation not in (0, 1, 2):
        raise ValueError(f"activation must be 0 (none), 1 (relu) or 2 (sigmoid), got {activation!r}")
    inputs = list(inputs)
    n = len(inputs) - 1
    if use_bias:
        if n % 2:
            raise ValueError(f"with use_bias, inputs must be [x, *weights, *biases]; got {len(inputs)} tensors")
        n //= 2
    x, weights, biases = inputs[0], inputs[1:1 + n], inputs[1 + n:] if use_bias else []
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise ValueError("inputs[0] must be a 2-D tensor [batch, features]")
    acts = (activation,) * n
    check_chain(x, weights, biases, acts)
    return x, weights, biases, acts


def forward(use_bias: int, activation: int, inputs) -> list[Tensor]:
    """``mlp_cuda.forward``: ``[output, reserved_space]`` (no autograd)."""
    x, weights, biases, acts = _split(use_bias, activation, inputs)
    out, outs, _, _ = chain_forward(x, weights, biases, acts)
    return [out, torch.cat([o.reshape(-1) for o in outs])]


def backward(use_bias: int, activation: int, grad_o: Tensor, fprop_outputs, inputs) -> list[Tensor]:
    """``mlp_cuda.backward``: the gradients of ``inputs`` (``[dx, *dweights, *dbiases]``)."""
    x, weights, biases, acts = _split(use_bias, activation, inputs)
    reserved = fprop_outputs[1]
    check_devices(x, ("grad_o", grad_o), ("fprop_outputs[1]", reserved))
    sizes = [x.shape[0] * w.shape[0] for w in weights]
    if reserved.numel() != sum(sizes):
        raise ValueError(f"fprop_outputs[1] has {reserved.numel()} elements, expected {sum(sizes)} "
                         "(the reserved space returned by forward)")
    outs = [r.view(x.shape[0], w.shape[0]) for r, w in zip(reserved.split(sizes), weights)]
    if tuple(grad_o.shape) != tuple(outs[-1].shape):
        raise ValueError(f"grad_o has shape {tuple(grad_o.shape)}, expected {tuple(outs[-1].shape)}")
    dx, dws, dbs = chain_backward(grad_o.to(x.dtype), x, weights, bool(use_bias), outs, [None] * len(outs), acts,
                                  _use_triton(x, *weights))
    return [dx, *dws, *(dbs if use_bias else [])]
