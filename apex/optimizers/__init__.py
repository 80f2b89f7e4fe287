"""Apex's fused optimizers: one multi-tensor update per (device, dtype) group on GPUs (Triton), PyTorch's
fused/foreach operators on CPUs."""

from apex.optimizers.fused_adagrad import FusedAdagrad
from apex.optimizers.fused_adam import FusedAdam
from apex.optimizers.fused_lamb import FusedLAMB
from apex.optimizers.fused_lars import Fused_LARS, FusedLARS
from apex.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from apex.optimizers.fused_novograd import FusedNovoGrad
from apex.optimizers.fused_sgd import FusedSGD

__all__ = ["FusedAdagrad", "FusedAdam", "FusedLAMB", "FusedLARS", "FusedMixedPrecisionLamb", "FusedNovoGrad",
           "FusedSGD", "Fused_LARS"]
