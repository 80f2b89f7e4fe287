"""Apex's module path for the fused SyncBatchNorm; here the same class as ``apex.parallel.SyncBatchNorm``."""

from apex.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
