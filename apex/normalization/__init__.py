"""Fused LayerNorm and RMSNorm (Apex's ``apex.normalization``), plus residual-add fusions.

``apex.normalization.fused_layer_norm`` is the submodule, as in Apex (its functional ``fused_layer_norm``
lives there), so ``apex.normalization.fused_layer_norm.FusedLayerNorm`` and the module's registered ops resolve.
"""

from apex.normalization.fused_layer_norm import (
    FusedLayerNorm,
    FusedLayerNormAffineFunction,
    FusedLayerNormAffineMixedDtypesFunction,
    FusedLayerNormFunction,
    FusedRMSNorm,
    FusedRMSNormAffineFunction,
    FusedRMSNormAffineMixedDtypesFunction,
    FusedRMSNormFunction,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_layer_norm_affine,
    fused_rms_norm,
    fused_rms_norm_affine,
    manual_rms_norm,
    mixed_dtype_fused_layer_norm_affine,
    mixed_dtype_fused_rms_norm_affine,
)
from apex.ops.fused_add_norm import fused_add_layer_norm, fused_add_rms_norm

__all__ = [
    "FusedLayerNorm",
    "FusedLayerNormAffineFunction",
    "FusedLayerNormAffineMixedDtypesFunction",
    "FusedLayerNormFunction",
    "FusedRMSNorm",
    "FusedRMSNormAffineFunction",
    "FusedRMSNormAffineMixedDtypesFunction",
    "FusedRMSNormFunction",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "fused_add_layer_norm",
    "fused_add_rms_norm",
    "fused_layer_norm_affine",
    "fused_rms_norm",
    "fused_rms_norm_affine",
    "manual_rms_norm",
    "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]
