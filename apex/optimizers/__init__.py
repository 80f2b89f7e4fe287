"""Apex's fused optimizers: one multi-tensor update per (device, dtype) group on GPUs (Triton), PyTorch's
fused/foreach operators on CPUs."""

from apex.optimizers.fused_adam import FusedAdam

__all__ = ["FusedAdam"]
