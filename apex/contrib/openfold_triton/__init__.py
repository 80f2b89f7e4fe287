"""Apex's ``apex.contrib.openfold_triton``: OpenFold's fused LayerNorm, attention and Adam+SWA optimizer.

Upstream is Triton-only (CUDA). Here the same names run apex's Triton kernels on GPUs and PyTorch's own
operators on CPUs; the kernels are also tested under the Triton interpreter. Nothing is imported from
Triton until a kernel runs.
"""

from __future__ import annotations

from apex.contrib.openfold_triton import mha
from apex.contrib.openfold_triton._tuning import (
    KERNELS,
    _load_triton_auto_tune_cache,
    _save_triton_auto_tune_cache,
    sync_triton_auto_tune_cache_across_gpus,
)
from apex.contrib.openfold_triton.layer_norm import LayerNormSmallShapeOptImpl
from apex.contrib.openfold_triton.mha import AttnBiasJIT, AttnNoBiasJIT, AttnTri, CanSchTriMHA

__all__ = (
    "LayerNormSmallShapeOptImpl",
    "sync_triton_auto_tune_cache_across_gpus",
    "CanSchTriMHA",
    "AttnTri",
    "AttnBiasJIT",
    "AttnNoBiasJIT",
)

_ = (mha, _load_triton_auto_tune_cache, _save_triton_auto_tune_cache)


def __getattr__(name: str):
    # Upstream's README assigns ``_tuneable_triton_kernels[name].cache``; the dict is built on first use.
    if name == "_tuneable_triton_kernels":
        return KERNELS.get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
