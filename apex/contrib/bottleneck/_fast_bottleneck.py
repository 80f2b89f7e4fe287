"""``forward`` and ``backward`` of Apex's ``fast_bottleneck`` extension (the fused Bottleneck block), with its
positional signatures, on PyTorch's convolutions.

``forward(explicit_nhwc, stride_1x1, inputs)`` with ``inputs = [x, w1, w2, w3, s1, s2, s3, b1, b2, b3]`` plus
``[w4, s4, b4]`` when the block has a downsampling shortcut (stride != 1 or channels change) returns
``[out1, out2, out3]``::

    out1 = relu(conv1x1(x, w1, stride) * s1 + b1)
    out2 = relu(conv3x3(out1, w2, pad 1) * s2 + b2)
    out3 = relu(conv1x1(out2, w3) * s3 + b3 + shortcut),  shortcut = conv1x1(x, w4, stride) * s4 + b4  or  x

``backward(explicit_nhwc, stride_1x1, inputs)`` with ``inputs = [x, w1, w2, w3, s1, s2, s3, b1, b2, b3,
grad_conv3, grad_conv4, out1, out2]`` (+ ``[w4]``), where ``grad_conv3 = (out3 > 0)·dy·s3`` and ``grad_conv4`` is
``(out3 > 0)·dy·s4`` with a shortcut conv, else ``(out3 > 0)·dy`` (as Apex's ``BottleneckFunction`` builds them),
returns ``[grad_x, grad_w1, grad_w2, grad_w3]`` (+ ``[grad_w4]``). With ``explicit_nhwc`` tensors are (N, H, W, C)
and weights (O, kH, kW, I); otherwise NCHW and (O, I, kH, kW). Outputs keep the input's dtype; the staged
entry points of Apex's extension (``forward_out1``, ``backward_grad_out1_halo``, ...) are not provided.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.grad import conv2d_input, conv2d_weight


def _nchw(t: torch.Tensor, nhwc: bool) -> torch.Tensor:
    return t.permute(0, 3, 1, 2) if nhwc else t


def _back(t: torch.Tensor, nhwc: bool) -> torch.Tensor:
    return t.permute(0, 2, 3, 1).contiguous() if nhwc else t.contiguous(memory_format=torch.channels_last)


def _unpack(inputs: Sequence[torch.Tensor], nhwc: bool, n_fixed: int, layout_dependent: frozenset[int]):
    """``inputs`` with the activations and weights (indices ``layout_dependent``) as NCHW views."""
    inputs = list(inputs)
    if len(inputs) not in (n_fixed, n_fixed + 1, n_fixed + 3):
        raise ValueError(f"inputs must hold {n_fixed} tensors (plus the shortcut's), got {len(inputs)}")
    for i in layout_dependent:
        if i < len(inputs) and (not isinstance(inputs[i], torch.Tensor) or inputs[i].dim() != 4):
            raise ValueError(f"inputs[{i}] must be a 4-d tensor, got {getattr(inputs[i], 'shape', inputs[i])!r}")
    return [_nchw(t, nhwc) if i in layout_dependent else t for i, t in enumerate(inputs)]


_FORWARD_4D = frozenset((0, 1, 2, 3, 10))  # x, w1, w2, w3, w4
_BACKWARD_4D = frozenset((0, 1, 2, 3, 10, 11, 12, 13, 14))  # ... grad_conv3, grad_conv4, out1, out2, w4


def _scale_bias(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1, 1, 1)


def _has_shortcut_conv(x, w3, stride: int) -> bool:
    return stride != 1 or w3.shape[0] != x.shape[1]


def forward(explicit_nhwc: bool, stride_1x1: int, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``fast_bottleneck.forward``: the frozen-BN bottleneck block's outputs from ``[x, w1, w2, w3, s1, s2, s3,
    b1, b2, b3(, w4, s4, b4)]`` (scales and biases of the frozen batch norms), as Apex's list."""
    t = _unpack(inputs, explicit_nhwc, 10, _FORWARD_4D)
    x, w1, w2, w3, s1, s2, s3, b1, b2, b3 = t[:10]
    shortcut_conv = _has_shortcut_conv(x, w3, stride_1x1)
    if shortcut_conv and len(t) != 13:
        raise ValueError("this block changes stride or channels: inputs must end with [w4, s4, b4]")
    out1 = torch.relu(F.conv2d(x, w1, stride=stride_1x1) * _scale_bias(s1) + _scale_bias(b1))
    out2 = torch.relu(F.conv2d(out1, w2, padding=1) * _scale_bias(s2) + _scale_bias(b2))
    shortcut = x
    if shortcut_conv:
        shortcut = F.conv2d(x, t[10], stride=stride_1x1) * _scale_bias(t[11]) + _scale_bias(t[12])
    out3 = torch.relu(F.conv2d(out2, w3) * _scale_bias(s3) + _scale_bias(b3) + shortcut)
    return [_back(o, explicit_nhwc) for o in (out1, out2, out3)]


def backward(explicit_nhwc: bool, stride_1x1: int, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``fast_bottleneck.backward``: the gradients of the input and the conv weights, from the forward's
    inputs plus the output gradient and the saved activations, as Apex's list."""
    t = _unpack(inputs, explicit_nhwc, 14, _BACKWARD_4D)
    x, w1, w2, w3, s1, s2, _s3, _b1, _b2, _b3, g3, g4, out1, out2 = t[:14]
    shortcut_conv = _has_shortcut_conv(x, w3, stride_1x1)
    if shortcut_conv and len(t) != 15:
        raise ValueError("this block changes stride or channels: inputs must end with [w4]")
    gw3 = conv2d_weight(out2, w3.shape, g3)
    g2 = conv2d_input(out2.shape, w3, g3) * (out2 > 0) * _scale_bias(s2)
    gw2 = conv2d_weight(out1, w2.shape, g2, padding=1)
    g1 = conv2d_input(out1.shape, w2, g2, padding=1) * (out1 > 0) * _scale_bias(s1)
    gw1 = conv2d_weight(x, w1.shape, g1, stride=stride_1x1)
    gx = conv2d_input(x.shape, w1, g1, stride=stride_1x1)
    grads = [gw1, gw2, gw3]
    if shortcut_conv:
        w4 = t[14]
        gx = gx + conv2d_input(x.shape, w4, g4, stride=stride_1x1)
        grads.append(conv2d_weight(x, w4.shape, g4, stride=stride_1x1))
    else:
        gx = gx + g4
    # weights' gradients in the weights' own layout, like Apex
    return [_back(gx, explicit_nhwc)] + [g.permute(0, 2, 3, 1).contiguous() if explicit_nhwc else g for g in grads]
