"""Apex's ``apex.contrib.cudnn_gbn``: ``GroupBatchNorm2d`` (batch norm over a group of ranks)."""

from apex.contrib.cudnn_gbn.batch_norm import GroupBatchNorm2d

__all__ = ["GroupBatchNorm2d"]
