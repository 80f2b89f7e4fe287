"""Tensor lists for the multi-tensor benchmarks."""

import torch


def mixed_sizes(n_tensors: int, max_size: int, seed: int = 0, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, max_size, (n_tensors,), generator=g).tolist()
    return [torch.randn(s, generator=g).to(dtype) for s in sizes]


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
