"""Fused optimizers with Apex's API: Triton multi-tensor kernels on GPUs, ``torch._foreach_*`` on CPUs."""

from apex.optimizers.fused_lamb import FusedLAMB
from apex.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from apex.optimizers.fused_novograd import FusedNovoGrad

__all__ = ["FusedLAMB", "FusedMixedPrecisionLamb", "FusedNovoGrad"]
