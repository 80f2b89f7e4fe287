"""Apex's ``apex.contrib.bottleneck``: the ResNet ``Bottleneck`` block (frozen batch norm) on PyTorch's
convolutions. ``SpatialBottleneck`` and the halo exchangers are not provided."""

from apex.contrib.bottleneck.bottleneck import Bottleneck, FrozenBatchNorm2d

__all__ = ["Bottleneck", "FrozenBatchNorm2d"]
