"""Apex's ``apex.contrib.group_norm``: GroupNorm with a fused SiLU for NHWC and NCHW inputs."""

from apex.contrib.group_norm.group_norm import GroupNorm

__all__ = ["GroupNorm"]
