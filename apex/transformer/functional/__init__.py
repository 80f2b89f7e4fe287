"""apex.transformer.functional: Megatron-LM's fused kernels (scale-mask-softmax, rotary embeddings,
bias-activation fusions, weight-gradient accumulation) on any shape, dtype and device.

Names are imported on first access, so ``import apex.transformer.functional`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from apex._compat import lazy_module

_NAMES = {
    # fused_softmax
    "FusedScaleMaskSoftmax": "apex.transformer.functional.fused_softmax",
    "GenericFusedScaleMaskSoftmax": "apex.transformer.functional.fused_softmax",
    "ScaledUpperTriangMaskedSoftmax": "apex.transformer.functional.fused_softmax",
    "ScaledMaskedSoftmax": "apex.transformer.functional.fused_softmax",
    "ScaledSoftmax": "apex.transformer.functional.fused_softmax",
    "GenericScaledMaskedSoftmax": "apex.transformer.functional.fused_softmax",
    "scaled_upper_triang_masked_softmax": "apex.transformer.functional.fused_softmax",
    "scaled_masked_softmax": "apex.transformer.functional.fused_softmax",
    "scaled_softmax": "apex.transformer.functional.fused_softmax",
    "generic_scaled_masked_softmax": "apex.transformer.functional.fused_softmax",
    # fused_rope
    "fused_apply_rotary_pos_emb": "apex.transformer.functional.fused_rope",
    "fused_apply_rotary_pos_emb_cached": "apex.transformer.functional.fused_rope",
    "fused_apply_rotary_pos_emb_thd": "apex.transformer.functional.fused_rope",
    "fused_apply_rotary_pos_emb_2d": "apex.transformer.functional.fused_rope",
    # fused_bias_activation
    "bias_swiglu": "apex.transformer.functional.fused_bias_activation",
    "bias_gelu": "apex.transformer.functional.fused_bias_activation",
    "swiglu": "apex.transformer.functional.fused_bias_activation",
    # fused_weight_gradient
    "wgrad_gemm_accum_fp32": "apex.transformer.functional.fused_weight_gradient",
    "wgrad_gemm_accum_fp16": "apex.transformer.functional.fused_weight_gradient",
}

if TYPE_CHECKING:  # pragma: no cover
    from apex.transformer.functional.fused_rope import (  # noqa: F401
        fused_apply_rotary_pos_emb,
        fused_apply_rotary_pos_emb_2d,
        fused_apply_rotary_pos_emb_cached,
        fused_apply_rotary_pos_emb_thd,
    )
    from apex.transformer.functional.fused_softmax import FusedScaleMaskSoftmax  # noqa: F401

__getattr__, __dir__ = lazy_module(globals(), _NAMES)
