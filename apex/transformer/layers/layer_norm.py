"""``apex.normalization``'s LayerNorms with Megatron's ``sequence_parallel_enabled`` keyword: it is stored on
the module and as an attribute of ``weight`` and ``bias``, so a trainer can all-reduce those gradients
over the tensor group when activations are split along the sequence.

``FastLayerNorm`` (apex.contrib's in upstream) is :class:`FusedLayerNorm` here: apex.transformer may not
depend on apex.contrib, and both compute the same LayerNorm over the last dimension.
"""

from __future__ import annotations

import torch

from apex.normalization import FusedLayerNorm as _FusedLayerNorm
from apex.normalization import MixedFusedLayerNorm as _MixedFusedLayerNorm

__all__ = ["FastLayerNorm", "FusedLayerNorm", "MixedFusedLayerNorm"]


def _set_sequence_parallel_enabled(param: torch.Tensor | None, sequence_parallel_enabled: bool) -> None:
    if param is not None:
        param.sequence_parallel_enabled = sequence_parallel_enabled


class FusedLayerNorm(_FusedLayerNorm):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True, *,
                 sequence_parallel_enabled: bool = False):
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=elementwise_affine)
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if self.elementwise_affine:
            _set_sequence_parallel_enabled(self.weight, sequence_parallel_enabled)
            _set_sequence_parallel_enabled(self.bias, sequence_parallel_enabled)


class MixedFusedLayerNorm(_MixedFusedLayerNorm):
    """:class:`FusedLayerNorm` whose output has the parameters' dtype."""

    def __init__(self, normalized_shape, eps: float = 1e-5, **kwargs):
        self.sequence_parallel_enabled = kwargs.pop("sequence_parallel_enabled", False)
        super().__init__(normalized_shape=normalized_shape, eps=eps, **kwargs)
        _set_sequence_parallel_enabled(self.weight, self.sequence_parallel_enabled)
        _set_sequence_parallel_enabled(self.bias, self.sequence_parallel_enabled)


class FastLayerNorm(FusedLayerNorm):
    def __init__(self, hidden_size, eps: float = 1e-5, *, sequence_parallel_enabled: bool = False):
        super().__init__(normalized_shape=hidden_size, eps=eps, elementwise_affine=True,
                         sequence_parallel_enabled=sequence_parallel_enabled)
