"""Apex's fused optimizers: one multi-tensor update per (device, dtype) group on GPUs (Triton), PyTorch's
fused/foreach operators on CPUs."""

from apex.optimizers.fused_adagrad import FusedAdagrad
from apex.optimizers.fused_adam import FusedAdam
from apex.optimizers.fused_lars import Fused_LARS, FusedLARS
from apex.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLARS", "FusedSGD", "Fused_LARS"]
