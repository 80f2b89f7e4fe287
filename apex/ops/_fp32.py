"""fp32 working copies of tensor lists for the PyTorch paths, which compute in fp32 whatever the storage
dtype: ``as_fp32`` gives the fp32 tensors themselves (updated in place) and fp32 copies of the others;
``write_back`` rounds the copies' results into the tensors they came from."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def as_fp32(ts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t if t.dtype == torch.float32 else t.float() for t in ts]


def write_back(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` where ``src[i]`` is a copy (not ``dst[i]`` itself), in one foreach call."""
    pairs = [(d, s) for d, s in zip(dst, src) if d is not s]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
