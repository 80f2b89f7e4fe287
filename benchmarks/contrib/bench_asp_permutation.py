"""ASP channel-permutation search: our vectorised best-swap search (every candidate swap of an iteration scored
by one batched tensor expression) against the same greedy search scoring one candidate swap at a time with
PyTorch operations (the shape of Apex's CPU fallback). Both apply the same swaps and return the same
permutation (checked). ``extra`` records the magnitude 2:4 pruning keeps without a permutation, with ours
("channel swap") and with the stripe-pair "exhaustive" search, and the unstructured-50% upper bound.
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case

SIZES = [(64, 32), (128, 64)]  # (rows, columns)


def _one_at_a_time(w: torch.Tensor) -> list:
    from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import kept_2_to_4

    a = w.abs().double().clone()
    cols = a.shape[1]
    perm = list(range(cols))
    for _ in range(2 * cols):
        best, pair = 1e-9, None
        for i in range(cols):
            for j in range(i + 1, cols):
                if i // 4 == j // 4:
                    continue
                s = [4 * (i // 4) + k for k in range(4)] + [4 * (j // 4) + k for k in range(4)]
                block = a[:, s]
                before = kept_2_to_4(block.reshape(-1, 2, 4)).sum()
                block[:, [i % 4, 4 + j % 4]] = block[:, [4 + j % 4, i % 4]]
                gain = float(kept_2_to_4(block.reshape(-1, 2, 4)).sum() - before)
                if gain > best:
                    best, pair = gain, (i, j)
        if pair is None:
            break
        i, j = pair
        a[:, [i, j]] = a[:, [j, i]]
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def _timed(rows: int, cols: int):
    from apex.contrib.sparsity.permutation_search_kernels import accelerated_search_for_good_permutation as search
    from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import (
        magnitude_after_pruning_rows,
        sum_after_2_to_4,
    )

    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0))
    ours_perm = search(w, {"strategy": "channel swap"})
    ref_perm = _one_at_a_time(w)
    exhaustive = search(w, {"strategy": "exhaustive", "escape_attempts": 0})
    extra = {
        "same_permutation_as_one_at_a_time": sum_after_2_to_4(w[:, ours_perm]) == sum_after_2_to_4(w[:, ref_perm]),
        "kept_no_permutation": round(sum_after_2_to_4(w), 3),
        "kept_channel_swap": round(sum_after_2_to_4(w[:, ours_perm]), 3),
        "kept_exhaustive_pairs": round(sum_after_2_to_4(w[:, exhaustive]), 3),
        "kept_unstructured_bound": round(magnitude_after_pruning_rows(w), 3),
    }
    return (lambda: search(w, {"strategy": "channel swap"})), (lambda: _one_at_a_time(w)), extra


def cases():
    return [Case(f"ASP permutation search {r}x{c} (channel swap)", timed=lambda r=r, c=c: _timed(r, c),
                 torch_label="one swap at a time", repeats=3, warmup=1) for r, c in SIZES]
