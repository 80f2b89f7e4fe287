"""Megatron-compatible LayerNorms carrying the ``sequence_parallel_enabled`` parameter attribute."""

from apex.transformer.layers.layer_norm import FastLayerNorm, FusedLayerNorm, MixedFusedLayerNorm

__all__ = ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]
