"""Apex's module path for SyncBatchNorm's autograd function."""

from apex.parallel.sync_batchnorm import SyncBatchnormFunction

__all__ = ["SyncBatchnormFunction"]
