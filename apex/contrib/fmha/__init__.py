"""Apex's ``apex.contrib.fmha``: packed variable-length multi-head attention on PyTorch's SDPA."""

from apex.contrib.fmha.fmha import FMHA, FMHAFun

__all__ = ["FMHA", "FMHAFun"]
