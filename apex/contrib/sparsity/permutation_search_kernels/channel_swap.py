"""Greedy channel swaps (Apex's ``permutation_search_kernels.channel_swap``), vectorised in PyTorch.

Every iteration scores *all* swaps of two columns in different stripes at once and applies the best one,
until no swap gains more than the threshold. With ``t1``/``t2`` the largest and second largest magnitude of
the other three columns of a position's stripe (per row), putting a column of magnitude ``x`` in that
position keeps ``t1 + max(t2, min(x, t1)) + relu(x - t1)``; summed over rows this gives the kept magnitude of
a stripe for every (position, incoming column) pair as one broadcast expression, evaluated in chunks of
positions to bound memory. After a swap only the two touched stripes and the two moved columns are
re-scored. The result is a local optimum: no single swap improves it; ``escape_attempts`` random swaps (from
a fixed-seed generator, so every rank finds the same permutation) try to leave it, kept only when the
re-optimised result is better.
"""

from __future__ import annotations

import time

import torch

from apex.contrib.sparsity.permutation_search_kernels.permutation_utilities import as_matrix, kept_2_to_4

__all__ = ["Channel_Swap"]


def _top2_of_others(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and column position: largest and second largest of the other 3 columns of its stripe."""
    rows, cols = a.shape
    st = a.reshape(rows, cols // 4, 1, 4).expand(rows, cols // 4, 4, 4).clone()
    st.masked_fill_(torch.eye(4, dtype=torch.bool, device=a.device), float("-inf"))
    top = torch.topk(st, 2, dim=-1).values
    return top[..., 0].reshape(rows, cols), top[..., 1].reshape(rows, cols)


def _replaced(t1: torch.Tensor, t2: torch.Tensor, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``out[p, c]``: kept magnitude of the stripe of position ``p`` with column ``x[:, c]`` in p's place."""
    out = torch.empty(t1.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    xx = x[:, None, :]
    for p0 in range(0, t1.shape[1], chunk):
        a1, a2 = t1[:, p0:p0 + chunk, None], t2[:, p0:p0 + chunk, None]
        out[p0:p0 + chunk] = (a1 + torch.maximum(a2, torch.minimum(xx, a1)) + torch.relu(xx - a1)).sum(0)
    return out


def greedy_swaps(a: torch.Tensor, perm: torch.Tensor, threshold: float = 1e-9, max_iterations: int | None = None,
                 deadline: float | None = None, verbosity: int = 0) -> int:
    """Apply best swaps to ``a`` (absolute values, float64) and ``perm`` in place; returns the swap count."""
    rows, cols = a.shape
    if cols <= 4:
        return 0
    max_iterations = 2 * cols if max_iterations is None else max_iterations
    chunk = max(1, 2**22 // max(1, rows * cols))
    stripe = torch.arange(cols, device=a.device) // 4
    same = stripe[:, None] == stripe[None, :]
    t1, t2 = _top2_of_others(a)
    rep = _replaced(t1, t2, a, chunk)  # rep[i, j]: stripe(i) with column j in i's place
    base = kept_2_to_4(a.reshape(rows, -1, 4)).sum(0)
    done = 0
    for _ in range(max_iterations):
        if deadline is not None and time.perf_counter() > deadline:
            break
        gain = (rep + rep.t() - base[stripe][:, None] - base[stripe][None, :]).masked_fill_(same, float("-inf"))
        best = int(torch.argmax(gain))
        i, j = divmod(best, cols)
        if float(gain[i, j]) <= threshold:
            break
        if verbosity > 2:
            print(f"[Channel_Swap] swap columns {i} and {j}, gain {float(gain[i, j]):.6g}")
        perm[[i, j]] = perm[[j, i]]
        a[:, [i, j]] = a[:, [j, i]]
        touched = torch.cat([torch.arange(4 * (k // 4), 4 * (k // 4) + 4, device=a.device) for k in (i, j)])
        t1[:, touched], t2[:, touched] = _top2_of_others(a[:, touched])
        rep[touched] = _replaced(t1[:, touched], t2[:, touched], a, chunk)
        rep[:, [i, j]] = _replaced(t1, t2, a[:, [i, j]], chunk)
        base[[i // 4, j // 4]] = kept_2_to_4(a[:, touched].reshape(rows, 2, 4)).sum(0)
        done += 1
    return done


def escape_and_refine(a: torch.Tensor, perm: torch.Tensor, refine, escape_attempts: int, seed: int = 1) -> None:
    """Try ``escape_attempts`` random cross-stripe swaps followed by ``refine(a, perm)``; keep improvements."""
    cols = a.shape[1]
    if escape_attempts <= 0 or cols <= 4:
        return
    gen = torch.Generator().manual_seed(seed)
    best = float(kept_2_to_4(a.reshape(a.shape[0], -1, 4)).sum())
    for _ in range(escape_attempts):
        i, j = torch.randint(cols, (2,), generator=gen).tolist()
        if i // 4 == j // 4:
            continue
        trial_a, trial_p = a.clone(), perm.clone()
        trial_a[:, [i, j]] = trial_a[:, [j, i]]
        trial_p[[i, j]] = trial_p[[j, i]]
        refine(trial_a, trial_p)
        value = float(kept_2_to_4(trial_a.reshape(a.shape[0], -1, 4)).sum())
        if value > best + 1e-9:
            best = value
            a.copy_(trial_a)
            perm.copy_(trial_p)


def Channel_Swap(matrix, escape_attempts: int = 0, verbosity: int = 0, permutation=None,
                 time_limit: float | None = None):  # noqa: N802 - Apex's name
    """Greedy best-swap search. Returns ``(matrix[:, permutation], seconds, permutation)`` with the matrix
    of the input's kind (tensor or NumPy array); ``permutation`` (a start order) defaults to the identity;
    ``time_limit`` (seconds, not in Apex) stops early."""
    start = time.perf_counter()
    src = as_matrix(matrix)
    perm = torch.arange(src.shape[1]) if permutation is None else torch.as_tensor(list(permutation))
    if sorted(perm.tolist()) != list(range(src.shape[1])):
        raise ValueError("permutation must be a permutation of the matrix's column indices")
    a = src.abs()[:, perm].contiguous()
    deadline = None if time_limit is None else start + time_limit
    greedy_swaps(a, perm, deadline=deadline, verbosity=verbosity)
    escape_and_refine(a, perm, lambda x, p: greedy_swaps(x, p, deadline=deadline), escape_attempts)
    out = matrix[:, perm.to(matrix.device)] if isinstance(matrix, torch.Tensor) else matrix[:, perm.numpy()]
    return out, time.perf_counter() - start, perm.tolist()
