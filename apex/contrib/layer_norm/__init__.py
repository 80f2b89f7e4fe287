"""Apex's ``apex.contrib.layer_norm``: ``FastLayerNorm`` on apex's LayerNorm kernels."""

from apex.contrib.layer_norm.layer_norm import FastLayerNorm, FastLayerNormFN

__all__ = ["FastLayerNorm", "FastLayerNormFN"]
