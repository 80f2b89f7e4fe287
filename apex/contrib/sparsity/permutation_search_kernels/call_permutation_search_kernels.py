"""``accelerated_search_for_good_permutation`` (Apex's entry point of the permutation search).

Strategies, by ``options["strategy"]`` (Apex's names and defaults):

- ``"exhaustive"`` (default): the stripe-group search of :mod:`.exhaustive_search`, options
  ``stripe_group_size`` (8) and ``escape_attempts`` (100).
- ``"progressive channel swap"``: the best-swap search of :mod:`.channel_swap` with
  ``progressive_search_time_limit`` (60 s) as a time bound and ``improvement_threshold`` (1e-9). Apex tries
  random swaps until the time runs out; ours scores every swap each step and stops at a local optimum.
- ``"channel swap"``: the same without a time bound (``escape_attempts``, default 0).
- ``"user defined"``: the identity (Apex's hook for a custom search).

The search runs on the matrix's own device in float64 and is deterministic, so every rank of a distributed
job finds the same permutation for the same weights.
"""

from __future__ import annotations

import time

import torch

from apex.contrib.sparsity.permutation_search_kernels.channel_swap import escape_and_refine, greedy_swaps
from apex.contrib.sparsity.permutation_search_kernels.exhaustive_search import search_matrix
from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import as_matrix

__all__ = ["accelerated_search_for_good_permutation"]

_STRATEGIES = ("exhaustive", "progressive channel swap", "channel swap", "user defined")


def accelerated_search_for_good_permutation(matrix_group, options: dict | None = None, verbosity: int = 0) -> list:
    """A permutation ``perm`` of the columns such that ``matrix_group[:, perm]`` keeps at least as much
    magnitude under 2:4 pruning as ``matrix_group`` (tensor or NumPy array, 2-d, columns a multiple of 4).
    ``options`` is filled in with the defaults of the chosen strategy, as Apex does."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise TypeError(f"options must be a dict, got {type(options).__name__}")
    strategy = options.setdefault("strategy", "exhaustive")
    if strategy not in _STRATEGIES:
        raise ValueError(f"options['strategy'] must be one of {_STRATEGIES}, got {strategy!r}")
    src = as_matrix(matrix_group)
    perm = torch.arange(src.shape[1], device=src.device)
    start = time.perf_counter()
    if strategy == "exhaustive":
        group = options.setdefault("stripe_group_size", 8)
        escapes = options.setdefault("escape_attempts", 100)
        if group not in (8, 12):
            raise ValueError(f"options['stripe_group_size'] must be 8 or 12, got {group}")
        perm = search_matrix(src.abs().contiguous(), perm, group // 4, int(escapes))
    elif strategy in ("progressive channel swap", "channel swap"):
        threshold = float(options.setdefault("improvement_threshold", 1e-9))
        deadline = None
        if strategy == "progressive channel swap":
            deadline = start + float(options.setdefault("progressive_search_time_limit", 60))
        a = src.abs().contiguous()
        greedy_swaps(a, perm, threshold, deadline=deadline, verbosity=verbosity)
        escape_and_refine(a, perm, lambda x, p: greedy_swaps(x, p, threshold, deadline=deadline),
                          int(options.get("escape_attempts", 0)))
    if verbosity > 1:
        print(f"[accelerated_search_for_good_permutation] strategy {strategy!r}: "
              f"{time.perf_counter() - start:.4f} s for a {tuple(src.shape)} matrix")
    return perm.tolist()
