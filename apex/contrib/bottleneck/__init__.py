"""Apex's ``apex.contrib.bottleneck``: the ResNet ``Bottleneck`` block (frozen batch norm) on PyTorch's
convolutions, ``SpatialBottleneck`` (the block over an input split along H across ranks) and its halo
exchangers on ``torch.distributed``."""

from apex.contrib.bottleneck.bottleneck import Bottleneck, FrozenBatchNorm2d
from apex.contrib.bottleneck.halo_exchangers import (
    HaloExchangerAllGather,
    HaloExchangerNoComm,
    HaloExchangerPeer,
    HaloExchangerSendRecv,
)
from apex.contrib.bottleneck.spatial_bottleneck import SpatialBottleneck

__all__ = ["Bottleneck", "FrozenBatchNorm2d", "HaloExchangerAllGather", "HaloExchangerNoComm", "HaloExchangerPeer",
           "HaloExchangerSendRecv", "SpatialBottleneck"]
