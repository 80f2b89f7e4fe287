"""Apex's ``permutation_search_cuda`` kernels with their positional signatures, over PyTorch.

Apex's CUDA extension takes flat float32 NumPy arrays plus their sizes and writes its results into output
arrays; these functions do the same (launch-shape arguments such as ``blocks``/``threads`` are accepted and
ignored) and return 0 as the extension does. Scores are computed in float64 with the batched window scorer of
:mod:`.exhaustive_search`, so ties and rounding can differ from the float32 GPU kernels in the last bits.
"""

from __future__ import annotations

import numpy as np
import torch

from apex.contrib.sparsity.permutation_search_kernels.exhaustive_search import window_sums

__all__ = ["subset_sum_after_2_to_4", "build_permute_map", "check_permutations", "build_swap_map"]


def _matrix_t(py_matrix, rows: int, cols: int) -> torch.Tensor:
    a = torch.as_tensor(np.asarray(py_matrix, dtype=np.float64).reshape(rows, cols))
    if cols % 4:
        raise ValueError(f"cols must be a multiple of 4, got {cols}")
    return a.abs().t().contiguous()


def _stripe_cols(stripes: torch.Tensor) -> torch.Tensor:
    return (stripes[..., None] * 4 + torch.arange(4)).reshape(*stripes.shape[:-1], -1)


def subset_sum_after_2_to_4(py_matrix, rows, cols, start_col, end_col, blocks, threads, py_output) -> int:
    """``py_output[0]``: magnitude kept by 2:4 pruning of columns ``[start_col, end_col)``."""
    at = _matrix_t(py_matrix, rows, cols)[start_col:end_col]
    stripes = torch.arange(at.shape[0] // 4)[None, :]
    py_output[0] = float(window_sums(at, _stripe_cols(stripes), torch.arange(at.shape[0])[None]).sum())
    return 0


def build_permute_map(py_matrix, rows, cols, py_stripes, num_groups, group_width, py_permutations, perm_length,
                      py_improvements, py_best_indices) -> int:
    """For each of ``num_groups`` groups of ``group_width`` stripes, the best of the permutations (rows of
    ``perm_length`` local column positions): improvement over the first permutation and its index."""
    at = _matrix_t(py_matrix, rows, cols)
    stripes = torch.as_tensor(np.asarray(py_stripes, dtype=np.int64)[: num_groups * group_width])
    perms = torch.as_tensor(np.asarray(py_permutations, dtype=np.int64)).reshape(-1, perm_length)
    sums = window_sums(at, _stripe_cols(stripes.reshape(num_groups, group_width)), perms)
    gain, best = (sums - sums[:, :1]).max(1)
    best = torch.where(gain > 0, best, torch.zeros_like(best))
    py_improvements[:num_groups] = gain.clamp_min(0).numpy()
    py_best_indices[:num_groups] = best.numpy()
    return 0


def check_permutations(py_matrix, rows, cols, py_stripe_groups, group_width, num_groups, py_permutations,
                       num_permutations, py_improvement, py_permutation) -> int:
    """Best of ``num_permutations`` permutations of the first stripe group: ``py_improvement[0]`` (over the
    first permutation) and ``py_permutation[0]`` (its index; 0 when none improves)."""
    imp, idx = np.zeros(1, dtype=np.float32), np.zeros(1, dtype=np.uint32)
    perms = np.asarray(py_permutations).reshape(-1)[: num_permutations * group_width * 4]
    build_permute_map(py_matrix, rows, cols, py_stripe_groups, 1, group_width, perms, group_width * 4, imp, idx)
    py_improvement[0], py_permutation[0] = imp[0], idx[0]
    return 0


def build_swap_map(py_matrix, rows, cols, py_stripe_pairs, py_output) -> int:
    """For each pair of stripes and each of the 16 swaps (column ``c0`` of the first with ``c1`` of the
    second, index ``4 * c0 + c1``): kept magnitude after the swap minus before, into ``py_output``."""
    at = _matrix_t(py_matrix, rows, cols)
    pairs = torch.as_tensor(np.asarray(py_stripe_pairs, dtype=np.int64)).reshape(-1, 2)
    swaps = torch.arange(8).repeat(17, 1)
    c0, c1 = torch.arange(4).repeat_interleave(4), 4 + torch.arange(4).repeat(4)
    rows_ = torch.arange(1, 17)
    swaps[rows_, c0], swaps[rows_, c1] = c1, c0  # row 0 stays the identity
    sums = window_sums(at, _stripe_cols(pairs), swaps)
    py_output[: 16 * len(pairs)] = (sums[:, 1:] - sums[:, :1]).reshape(-1).numpy()
    return 0
