"""Stripe-group exhaustive search (Apex's ``permutation_search_kernels.exhaustive_search``), in PyTorch.

A *window* is a group of ``g = stripe_group_size / 4`` stripes (4 columns each). Its ``4g`` columns can be
re-split into ``g`` unordered groups of 4 in ``(4g)! / (g! 4!^g)`` ways (35 for ``g = 2``, 5775 for ``g = 3``);
order inside a stripe and of the stripes does not matter to 2:4 pruning. Every split of every window is
scored at once (``a[:, window_columns][:, :, splits]`` then a top-2 per group, in chunks to bound memory);
the best improving (window, split) is applied, and only the windows sharing a stripe with it are re-scored.
This repeats until no window improves (an optimum for every re-arrangement of any ``g`` stripes, stronger
than single swaps); ``escape_attempts`` random cross-stripe swaps (fixed seed: deterministic on every rank)
then try to leave that optimum, each kept only when the re-converged result is better.
"""

from __future__ import annotations

import functools
import itertools
import time

import torch

from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import as_matrix, kept_2_to_4

__all__ = ["Exhaustive_Search", "generate_unique_combinations", "search_matrix", "window_sums"]

_BUDGET = 2**22  # elements of one scoring chunk


@functools.lru_cache(maxsize=4)
def _splits(width: int) -> torch.Tensor:
    """All splits of ``range(width)`` into unordered groups of 4, the identity first: ``(n, width)``."""
    def rec(rest):
        if not rest:
            yield ()
            return
        for tail3 in itertools.combinations(rest[1:], 3):
            group = (rest[0], *tail3)
            left = tuple(c for c in rest if c not in group)
            for more in rec(left):
                yield group + more
    return torch.tensor(list(rec(tuple(range(width)))), dtype=torch.long)


def generate_unique_combinations(group_width: int) -> list:
    """The distinct re-arrangements of ``group_width`` stripes' columns (Apex's helper), identity first."""
    return _splits(4 * group_width).tolist()


def window_sums(at: torch.Tensor, cols: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
    """``out[w, p]``: magnitude kept by 2:4 pruning of the columns ``cols[w]`` re-ordered by ``perms[p]``
    (positions index into ``cols[w]``). ``at`` is the transposed matrix (columns, rows), so every gathered
    candidate is a contiguous run of rows; chunks over windows and rows bound the memory."""
    rows = at.shape[1]
    n_w, width = cols.shape
    n_s = perms.shape[0]
    per_row = n_s * width
    row_chunk = max(1, min(rows, _BUDGET // per_row))
    win_chunk = max(1, _BUDGET // (per_row * row_chunk))
    out = torch.zeros(n_w, n_s, dtype=at.dtype, device=at.device)
    for w0 in range(0, n_w, win_chunk):
        split_cols = cols[w0:w0 + win_chunk][:, perms]  # (w, n_s, width): the column put at each position
        for r0 in range(0, rows, row_chunk):
            v = at[:, r0:r0 + row_chunk][split_cols]  # (w, n_s, width, r)
            kept = kept_2_to_4(v.reshape(*v.shape[:2], width // 4, 4, v.shape[-1]), dim=3)  # (w, n_s, g, r)
            out[w0:w0 + split_cols.shape[0]] += kept.sum((2, 3))
    return out


def _score(at: torch.Tensor, cols: torch.Tensor, splits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Best gain over the first split (the identity) and its index, for each window."""
    sums = window_sums(at, cols, splits)
    return (sums - sums[:, :1]).max(1)


class _Search:
    def __init__(self, a: torch.Tensor, perm: torch.Tensor, group: int, threshold: float):
        self.a, self.perm, self.threshold = a, perm, threshold
        stripes = a.shape[1] // 4
        self.windows = torch.combinations(torch.arange(stripes, device=a.device), group)
        if self.windows.dim() == 1:  # windows of one stripe
            self.windows = self.windows[:, None]
        self.cols = (self.windows[:, :, None] * 4 + torch.arange(4, device=a.device)).reshape(len(self.windows), -1)
        self.member = torch.zeros(len(self.windows), stripes, dtype=torch.bool, device=a.device)
        self.member.scatter_(1, self.windows, True)
        self.splits = _splits(4 * group).to(a.device)
        self.gains = torch.zeros(len(self.windows), dtype=a.dtype, device=a.device)
        self.best = torch.zeros(len(self.windows), dtype=torch.long, device=a.device)
        self.dirty = torch.ones(len(self.windows), dtype=torch.bool, device=a.device)

    def converge(self, deadline: float | None) -> None:
        for _ in range(4 * self.a.shape[1] + 16):
            idx = self.dirty.nonzero().flatten()
            if len(idx):
                self.gains[idx], self.best[idx] = _score(self.a.t().contiguous(), self.cols[idx], self.splits)
                self.dirty.zero_()
            w = int(torch.argmax(self.gains))
            if float(self.gains[w]) <= self.threshold or (deadline is not None and time.perf_counter() > deadline):
                return
            cols = self.cols[w]
            order = cols[self.splits[self.best[w]]]
            self.a[:, cols] = self.a[:, order]
            self.perm[cols] = self.perm[order]
            self.dirty = self.member[:, self.windows[w]].any(1)

    def total(self) -> float:
        return float(kept_2_to_4(self.a.reshape(self.a.shape[0], -1, 4)).sum())

    def escape(self, attempts: int, deadline: float | None, seed: int = 1) -> None:
        gen = torch.Generator().manual_seed(seed)
        best = self.total()
        cols = self.a.shape[1]
        for _ in range(attempts):
            if deadline is not None and time.perf_counter() > deadline:
                return
            i, j = torch.randint(cols, (2,), generator=gen).tolist()
            if i // 4 == j // 4:
                continue
            saved = (self.a.clone(), self.perm.clone(), self.gains.clone(), self.best.clone())
            self.a[:, [i, j]] = self.a[:, [j, i]]
            self.perm[[i, j]] = self.perm[[j, i]]
            self.dirty = self.member[:, [i // 4, j // 4]].any(1)
            self.converge(deadline)
            value = self.total()
            if value > best + self.threshold:
                best = value
            else:
                self.a, self.perm, self.gains, self.best = saved
                self.dirty.zero_()


def search_matrix(a: torch.Tensor, perm: torch.Tensor, group_width: int = 2, escape_attempts: int = 0,
                  threshold: float = 1e-9, deadline: float | None = None) -> torch.Tensor:
    """Run the search on ``a`` (absolute values, float64, already in ``perm`` order); returns the new order."""
    stripes = a.shape[1] // 4
    group = max(1, min(group_width, stripes))
    if stripes < 2:
        return perm
    state = _Search(a, perm, group, threshold)
    state.converge(deadline)
    state.escape(escape_attempts, deadline)
    return state.perm


def Exhaustive_Search(matrix, stripe_group_size: int = -1, escape_attempts: int = 0, permutation=None,
                      time_limit: float | None = None):  # noqa: N802 - Apex's name
    """Returns ``(matrix[:, permutation], seconds, permutation)`` (the matrix of the input's kind).
    ``stripe_group_size`` is in columns (8: pairs of stripes, 12: triples; -1: the whole matrix when it has at
    most 12 columns, else 8); ``time_limit`` (seconds, not in Apex) stops early."""
    start = time.perf_counter()
    src = as_matrix(matrix)
    cols = src.shape[1]
    if stripe_group_size == -1:
        stripe_group_size = cols if cols <= 12 else 8
    if stripe_group_size not in (4, 8, 12):
        raise ValueError(f"stripe_group_size must be 8 or 12 columns (or -1), got {stripe_group_size}")
    perm = torch.arange(cols) if permutation is None else torch.as_tensor(list(permutation))
    if sorted(perm.tolist()) != list(range(cols)):
        raise ValueError("permutation must be a permutation of the matrix's column indices")
    a = src.abs()[:, perm].contiguous()
    deadline = None if time_limit is None else start + time_limit
    perm = search_matrix(a, perm.to(a.device), stripe_group_size // 4, escape_attempts, deadline=deadline).cpu()
    out = matrix[:, perm.to(matrix.device)] if isinstance(matrix, torch.Tensor) else matrix[:, perm.numpy()]
    return out, time.perf_counter() - start, perm.tolist()
