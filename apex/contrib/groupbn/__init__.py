"""Apex's ``apex.contrib.groupbn``: ``BatchNorm2d_NHWC`` (group batch norm on NHWC tensors)."""

from apex.contrib.groupbn.batch_norm import BatchNorm2d_NHWC

__all__ = ["BatchNorm2d_NHWC"]
