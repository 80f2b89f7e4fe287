"""Apex's fused convolution blocks on PyTorch's convolution (cuDNN / oneDNN, channels_last kept):

* ``ConvBiasReLU(x, weight, bias, padding, stride)`` = ``relu(conv2d(x, weight) + bias)``
* ``ConvBias(x, weight, bias, padding, stride)`` = ``conv2d(x, weight) + bias``
* ``ConvBiasMaskReLU(x, weight, bias, mask, padding, stride)`` = ``relu((conv2d(x, weight) + bias)·mask)``
* ``ConvFrozenScaleBiasReLU(x, weight, scale, bias, padding, stride)`` = ``relu(conv2d(x, weight)·scale + bias)``
  (``scale`` and ``bias`` are constants: no gradient)

``bias``/``scale`` are (1, C_out, 1, 1) (or (C_out,)); ``padding`` and ``stride`` are ints (square). Dtype
policy: as Apex's ``custom_fwd(cast_inputs=torch.half)``, under autocast on the inputs' device the floating
inputs are cast to fp16 and the block runs in fp16; otherwise in the inputs' dtype. The ReLU is applied in
place on the convolution's output (the convolution's backward does not need it), so the block keeps one
activation. ``fused_conv_bias_relu`` compatibility functions take Apex's positional arguments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _pair(v, name):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return (v, v)


def _prepare(x, weight, *rest):
    if not isinstance(x, Tensor) or x.dim() != 4 or not isinstance(weight, Tensor) or weight.dim() != 4:
        raise ValueError("x and weight must be 4-D (N, C, H, W) and (C_out, C_in, kH, kW) tensors")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has {x.shape[1]} channels but weight expects {weight.shape[1]}")
    tensors = (x, weight, *rest)
    if torch.is_autocast_enabled(x.device.type):
        tensors = tuple(t.half() if isinstance(t, Tensor) and t.is_floating_point() else t for t in tensors)
    return tensors


def _channel(v: Tensor, c_out: int, name: str) -> Tensor:
    if v.numel() != c_out:
        raise ValueError(f"{name} must have {c_out} elements (one per output channel), got {tuple(v.shape)}")
    return v.reshape(c_out)


def _conv(x, weight, bias, padding, stride):
    with torch.autocast(x.device.type, enabled=False):
        return F.conv2d(x, weight, bias, _pair(stride, "stride"), _pair(padding, "padding"))


def ConvBiasReLU(x: Tensor, weight: Tensor, bias: Tensor, padding: int, stride: int) -> Tensor:  # noqa: N802
    """``relu(conv2d(x, weight) + bias)`` with ``padding`` and ``stride`` on both spatial dims.

    A channels_last input stays channels_last; the bias (``[C]`` or ``[1, C, 1, 1]``) and the ReLU are
    applied in place on the convolution's output. Differentiable in ``x``, ``weight`` and ``bias``.
    """
    x, weight, bias = _prepare(x, weight, bias)
    return torch.relu_(_conv(x, weight, _channel(bias, weight.shape[0], "bias"), padding, stride))


def ConvBias(x: Tensor, weight: Tensor, bias: Tensor, padding: int, stride: int) -> Tensor:  # noqa: N802
    """``conv2d(x, weight) + bias`` with ``padding`` and ``stride``, the bias added in place on the output."""
    x, weight, bias = _prepare(x, weight, bias)
    return _conv(x, weight, _channel(bias, weight.shape[0], "bias"), padding, stride)


def ConvBiasMaskReLU(x: Tensor, weight: Tensor, bias: Tensor, mask: Tensor, padding: int,  # noqa: N802
                     stride: int) -> Tensor:
    """``relu((conv2d(x, weight) + bias) * mask)``; ``mask`` has the output's shape (``ValueError`` otherwise)."""
    x, weight, bias = _prepare(x, weight, bias)
    y = _conv(x, weight, _channel(bias, weight.shape[0], "bias"), padding, stride)
    if tuple(mask.shape) != tuple(y.shape):
        raise ValueError(f"mask must have the output's shape {tuple(y.shape)}, got {tuple(mask.shape)}")
    return torch.relu_(y * mask.to(y.dtype))


def ConvFrozenScaleBiasReLU(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor, padding: int,  # noqa: N802
                            stride: int) -> Tensor:
    """``relu(conv2d(x, weight) * scale + bias)`` with per-channel ``scale`` and ``bias`` that receive
    no gradient (a frozen batch norm folded into the convolution).
    """
    x, weight, scale, bias = _prepare(x, weight, scale, bias)
    c = weight.shape[0]
    s = _channel(scale, c, "scale").detach().view(1, c, 1, 1)
    b = _channel(bias, c, "bias").detach().view(1, c, 1, 1)
    return torch.relu_(torch.addcmul(b, _conv(x, weight, None, padding, stride), s))


# -------------------------------------------------------------------- compat: fused_conv_bias_relu.*
def _conv_backward(grad, x, weight, padding, stride, bias: bool):
    dx, dw, db = torch.ops.aten.convolution_backward(
        grad, x, weight, [weight.shape[0]] if bias else None, list(_pair(stride, "stride")),
        list(_pair(padding, "padding")), [1, 1], False, [0, 0], 1, [True, True, bias])
    return dx, dw, (db.view(1, -1, 1, 1) if bias else None)


def forward(inputs, padding, stride):
    """``[relu(conv(x, w) + b)]`` from ``[x, w, b]``."""
    x, w, b = inputs
    with torch.no_grad():
        return [ConvBiasReLU(x, w, b, padding, stride)]


def backward(inputs, padding, stride):
    """``[dx, dw, db]`` from ``[x, w, relu_output, grad_output]``."""
    x, w, out, grad = inputs
    return list(_conv_backward(grad * (out > 0), x, w, padding, stride, True))


def forward_no_relu(inputs, padding, stride):
    """Upstream's ``fused_conv_bias_relu.forward_no_relu(inputs, padding, stride)``: ``[ConvBias(*inputs)]``
    without autograd.
    """
    x, w, b = inputs
    with torch.no_grad():
        return [ConvBias(x, w, b, padding, stride)]


def backward_no_relu(inputs, padding, stride):
    """``[dx, dw, db]`` from ``[x, w, grad_output]``."""
    x, w, grad = inputs
    return list(_conv_backward(grad, x, w, padding, stride, True))


def forward_mask(inputs, padding, stride):
    """Upstream's ``fused_conv_bias_relu.forward_mask(inputs, padding, stride)``: ``[ConvBiasMaskReLU(*inputs)]``
    without autograd.
    """
    x, w, b, mask = inputs
    with torch.no_grad():
        return [ConvBiasMaskReLU(x, w, b, mask, padding, stride)]


def forward_cscale_cbias_relu(inputs, padding, stride):
    """Upstream's ``fused_conv_bias_relu.forward_cscale_cbias_relu(inputs, padding, stride)``: the output of
    ``ConvFrozenScaleBiasReLU(*inputs)`` without autograd.
    """
    x, w, scale, b = inputs
    with torch.no_grad():
        return ConvFrozenScaleBiasReLU(x, w, scale, b, padding, stride)


def backward_cscale_cbias_relu(inputs, padding, stride):
    """``[dx, dw]`` from ``[x, w, scale, relu_output, grad_output]``."""
    x, w, scale, out, grad = inputs
    g = grad * (out > 0) * scale.reshape(1, -1, 1, 1).to(grad.dtype)
    dx, dw, _ = _conv_backward(g, x, w, padding, stride, False)
    return [dx, dw]
