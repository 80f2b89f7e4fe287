"""Apex's ResNet ``Bottleneck`` block with frozen batch norms, on PyTorch's convolutions.

``out = relu(bn3(conv3(relu(bn2(conv2(relu(bn1(conv1(x)))))))) + shortcut(x))`` with ``conv1`` 1×1 (stride),
``conv2`` 3×3, ``conv3`` 1×1 and the shortcut a strided 1×1 conv + frozen BN when the shape changes. A frozen
batch norm is ``x·scale + bias`` with ``scale = weight / sqrt(running_var)`` (no eps, as Apex) and
``bias = bias − running_mean·scale``. ``explicit_nhwc=True`` takes and returns (N, H, W, C) tensors and
stores the convolution weights as (O, kH, kW, I), as Apex does; the convolutions then run on
channels_last views. ``use_cudnn`` selected Apex's fused cuDNN kernels and is accepted for compatibility.
Apex's ``SpatialBottleneck`` (spatially split across ranks with halo exchange) is in ``spatial_bottleneck.py``.
``groups != 1``, ``dilation != 1`` or a ``norm_func`` raise ``ValueError``, also the ``RuntimeError`` Apex raised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.init import kaiming_uniform_

from apex._errors import RuntimeValueError


class FrozenBatchNorm2d(nn.Module):
    """Batch norm with fixed statistics and affine parameters (buffers, no gradients)."""

    def __init__(self, n):
        super().__init__()
        self.register_buffer("weight", torch.ones(n))
        self.register_buffer("bias", torch.zeros(n))
        self.register_buffer("running_mean", torch.zeros(n))
        self.register_buffer("running_var", torch.ones(n))

    def get_scale_bias(self, nhwc: bool):
        scale = self.weight * self.running_var.rsqrt()
        bias = self.bias - self.running_mean * scale
        shape = (1, 1, 1, -1) if nhwc else (1, -1, 1, 1)
        return scale.reshape(shape), bias.reshape(shape)

    def forward(self, x):
        scale, bias = self.get_scale_bias(False)
        return torch.addcmul(bias.to(x.dtype), x, scale.to(x.dtype))


def conv3x3(in_planes, out_planes, stride=1, groups=1, dilation=1):
    """A bias-free 3x3 ``nn.Conv2d`` with padding ``dilation`` (torchvision's helper, as Apex has it)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=dilation, groups=groups,
                     bias=False, dilation=dilation)


def conv1x1(in_planes, out_planes, stride=1):
    """A bias-free 1x1 ``nn.Conv2d`` (torchvision's helper, as Apex has it)."""
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class Bottleneck(nn.Module):
    def __init__(self, in_channels, bottleneck_channels, out_channels, stride=1, groups=1, dilation=1,
                 norm_func=None, use_cudnn=False, explicit_nhwc=False):
        super().__init__()
        if groups != 1:
            raise RuntimeValueError("Bottleneck supports groups == 1 only")
        if dilation != 1:
            raise RuntimeValueError("Bottleneck supports dilation == 1 only")
        if norm_func is not None:
            raise RuntimeValueError("Bottleneck supports frozen batch norm only (norm_func=None)")
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(conv1x1(in_channels, out_channels, stride), FrozenBatchNorm2d(out_channels))
        self.conv1 = conv1x1(in_channels, bottleneck_channels, stride)
        self.conv2 = conv3x3(bottleneck_channels, bottleneck_channels)
        self.conv3 = conv1x1(bottleneck_channels, out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.stride = stride
        self.bn1 = FrozenBatchNorm2d(bottleneck_channels)
        self.bn2 = FrozenBatchNorm2d(bottleneck_channels)
        self.bn3 = FrozenBatchNorm2d(out_channels)
        self.use_cudnn = use_cudnn
        self.w_conv = [self.conv1.weight, self.conv2.weight, self.conv3.weight]
        if self.downsample is not None:
            self.w_conv.append(self.downsample[0].weight)
        for w in self.w_conv:
            kaiming_uniform_(w, a=1)
        self.explicit_nhwc = explicit_nhwc
        if explicit_nhwc:
            for p in self.parameters():
                with torch.no_grad():
                    p.data = p.data.permute(0, 2, 3, 1).contiguous()

    def _conv(self, conv, x, stride=1, padding=0):
        w = conv.weight.permute(0, 3, 1, 2) if self.explicit_nhwc else conv.weight
        return F.conv2d(x, w, None, stride, padding)

    def forward(self, x):
        if self.explicit_nhwc:
            if x.dim() != 4:
                raise ValueError(f"explicit_nhwc expects (N, H, W, C) input, got shape {tuple(x.shape)}")
            x = x.permute(0, 3, 1, 2)  # a channels_last NCHW view
        out = self.relu(self.bn1(self._conv(self.conv1, x, self.stride)))
        out = self.relu(self.bn2(self._conv(self.conv2, out, 1, 1)))
        out = self.bn3(self._conv(self.conv3, out))
        identity = x
        if self.downsample is not None:
            identity = self.downsample[1](self._conv(self.downsample[0], x, self.stride))
        out = self.relu(out + identity)
        return out.permute(0, 2, 3, 1) if self.explicit_nhwc else out
