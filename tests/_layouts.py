"""Saved-tensor hooks for tests of backwards that must read the saved tensors in the layout they get back (an
offloading or compressing hook may return any layout; ``save_on_cpu`` makes a strided tensor dense)."""

import torch


def column_major(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose last two dimensions are laid out column-major (``t`` itself where it has fewer than
    two dimensions of more than one element there)."""
    if t.dim() >= 2 and t.shape[-1] > 1 and t.shape[-2] > 1:
        return t.detach().transpose(-1, -2).contiguous().transpose(-1, -2)
    return t


def dense(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``t`` (of 2 dimensions or more; ``t`` itself otherwise), as ``save_on_cpu`` makes."""
    return t.detach().clone(memory_format=torch.contiguous_format) if t.dim() >= 2 else t
