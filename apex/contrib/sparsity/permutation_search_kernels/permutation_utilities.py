"""Shared pieces of the permutation search (Apex's ``permutation_search_kernels.permutation_utilities``).

2:4 pruning keeps the two largest magnitudes of every group of 4 consecutive columns ("stripe") of a row;
``sum_after_2_to_4(W)`` is the magnitude it keeps, the quantity the permutation search maximises. Everything
here is a tensor operation over all rows and stripes at once; matrices may be NumPy arrays or tensors and are
scored in float64 (the sums of thousands of magnitudes stay exact enough to compare permutations).
"""

from __future__ import annotations

import torch

__all__ = ["as_matrix", "kept_2_to_4", "apply_2_to_4", "sum_after_2_to_4", "try_swap", "efficacy",
           "magnitude_after_pruning_rows"]


def as_matrix(matrix) -> torch.Tensor:
    """``matrix`` as a float64 tensor (a copy for NumPy input); 2-d with a multiple of 4 columns."""
    if isinstance(matrix, torch.Tensor):
        t = matrix.detach()
    else:
        import numpy as np  # only for array input: numpy is optional for apex

        t = torch.as_tensor(np.asarray(matrix))
    if t.dim() != 2 or t.shape[1] % 4:
        raise ValueError(f"matrix must be 2-d with a multiple of 4 columns, got shape {tuple(t.shape)}")
    return t.to(torch.float64)


def kept_2_to_4(groups: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Magnitude kept by 2:4 pruning of ``groups`` of absolute values, 4 along ``dim``: the sum of the top 2,
    as ``max(m1, m2) + max(min(m1, m2), max(n1, n2))`` with ``m``/``n`` the max/min of the two pairs (four
    elementwise ops instead of a sort)."""
    a, b, c, d = groups.unbind(dim)
    m1, n1 = torch.maximum(a, b), torch.minimum(a, b)
    m2, n2 = torch.maximum(c, d), torch.minimum(c, d)
    return torch.maximum(m1, m2) + torch.maximum(torch.minimum(m1, m2), torch.maximum(n1, n2))


def apply_2_to_4(matrix):
    """Zero the two smallest magnitudes of every group of 4 along the rows (in place for NumPy arrays and
    tensors, as Apex's; also returned)."""
    t = as_matrix(matrix)
    groups = t.abs().reshape(t.shape[0], -1, 4)
    drop = torch.topk(groups, 2, dim=-1, largest=False).indices
    keep = torch.ones_like(groups, dtype=torch.bool).scatter_(-1, drop, False).reshape(t.shape)
    if isinstance(matrix, torch.Tensor):
        return matrix.mul_(keep.to(matrix.device))
    matrix *= keep.numpy()  # a NumPy array came in, so NumPy is there
    return matrix


def sum_after_2_to_4(matrix) -> float:
    """Sum of the magnitudes that survive 2:4 pruning along the rows of ``matrix`` (tensor or array)."""
    a = as_matrix(matrix).abs()
    return float(kept_2_to_4(a.reshape(a.shape[0], -1, 4)).sum())


def try_swap(matrix, dst: int, src: int) -> tuple[float, float]:
    """Kept magnitude of the two stripes holding columns ``dst`` and ``src`` after swapping the two columns,
    and its improvement over not swapping (Apex's ``try_swap``; ``matrix`` is not changed)."""
    a = as_matrix(matrix).abs()
    s0, s1 = dst // 4, src // 4
    if s0 == s1:
        return 0.0, 0.0
    cols = torch.tensor([4 * s0 + i for i in range(4)] + [4 * s1 + i for i in range(4)])
    before = float(kept_2_to_4(a[:, cols].reshape(-1, 2, 4)).sum())
    swapped = a[:, cols].clone()
    i, j = dst % 4, 4 + src % 4
    swapped[:, [i, j]] = swapped[:, [j, i]]
    after = float(kept_2_to_4(swapped.reshape(-1, 2, 4)).sum())
    return after, after - before


def efficacy(optimal_lost_magnitude: float, base_lost_magnitude: float, cur_lost_magnitude: float) -> float:
    """Fraction of the avoidable loss that a permutation recovered (1.0 = optimal; Apex's definition)."""
    if base_lost_magnitude == optimal_lost_magnitude:
        return 1.0
    return (base_lost_magnitude - cur_lost_magnitude) / (base_lost_magnitude - optimal_lost_magnitude)


def magnitude_after_pruning_rows(matrix, rate: float = 0.5) -> float:
    """Magnitude kept by unstructured pruning of ``rate`` of every row (an upper bound for any 2:4 order)."""
    a = as_matrix(matrix).abs()
    keep = a.shape[1] - int(a.shape[1] * rate)
    return float(torch.topk(a, keep, dim=1).values.sum())
