"""Input-channel permutation search for 2:4 sparsity (Apex's ``permutation_search_kernels``), in PyTorch.

Permuting a weight's input channels (columns) before 2:4 pruning changes which columns share a group of 4,
and with it the magnitude that pruning keeps. The search maximises ``sum_after_2_to_4(W[:, perm])``.

Strategy (one for every ``options["strategy"]`` name Apex accepts): greedy best swap. Every iteration
scores *all* column swaps between different stripes (groups of 4) at once: for each stripe ``s``, position
``q`` in it and outside column ``c``, the kept magnitude of ``s`` with ``c`` in place of ``q`` is one batched
top-2 over ``(rows, stripes, 4, columns)``; the best swap is applied if it gains more than
``improvement_threshold``, until none does or ``max_iterations`` (default ``2 * columns``) is reached.
Each iteration costs O(rows * columns**2) work in a few tensor operations (scores are evaluated in chunks of
stripes to bound memory). It finds a local optimum (no single swap improves), not Apex's exhaustive
stripe-group optimum; the search runs in float64 on the matrix's device and is deterministic.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["accelerated_search_for_good_permutation", "sum_after_2_to_4"]

_STRATEGIES = ("exhaustive", "progressive channel swap", "channel swap", "user defined")


def _as_matrix(matrix) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(matrix)) if not isinstance(matrix, torch.Tensor) else matrix.detach()
    if t.dim() != 2 or t.shape[1] % 4:
        raise ValueError(f"matrix must be 2-d with a multiple of 4 columns, got shape {tuple(t.shape)}")
    return t.to(torch.float64)


def _kept(groups: torch.Tensor) -> torch.Tensor:
    """Magnitude kept by 2:4 pruning of ``groups`` (..., 4) of absolute values: the sum of the top 2."""
    return torch.topk(groups, 2, dim=-1).values.sum(-1)


def sum_after_2_to_4(matrix) -> float:
    """Sum of the magnitudes that survive 2:4 pruning along the rows of ``matrix`` (tensor or array)."""
    a = _as_matrix(matrix).abs()
    return float(_kept(a.reshape(a.shape[0], -1, 4)).sum())


def _top2_of_others(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For every column position, the largest and second largest of the other 3 columns of its stripe
    (per row): two ``(rows, columns)`` tensors."""
    rows, cols = a.shape
    st = a.reshape(rows, cols // 4, 1, 4).expand(rows, cols // 4, 4, 4).clone()
    eye = torch.eye(4, dtype=torch.bool, device=a.device)
    st.masked_fill_(eye, float("-inf"))
    top = torch.topk(st, 2, dim=-1).values  # (R, S, 4, 2)
    return top[..., 0].reshape(rows, cols), top[..., 1].reshape(rows, cols)


def _replaced(t1: torch.Tensor, t2: torch.Tensor, x: torch.Tensor, chunk: int) -> torch.Tensor:
    """``out[p, c]``: magnitude kept by the stripe of position p with column ``x[:, c]`` in p's place, i.e.
    ``sum_r top2(t1, t2, x) = t1 + max(t2, min(x, t1)) + relu(x - t1)``."""
    out = torch.empty(t1.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    for p0 in range(0, t1.shape[1], chunk):
        a1, a2 = t1[:, p0:p0 + chunk, None], t2[:, p0:p0 + chunk, None]
        xx = x[:, None, :]
        kept = a1 + torch.maximum(a2, torch.minimum(xx, a1)) + torch.relu(xx - a1)
        out[p0:p0 + chunk] = kept.sum(0)
    return out


def accelerated_search_for_good_permutation(matrix_group, options=None, verbosity: int = 0) -> list[int]:
    """A permutation ``perm`` of the columns such that ``matrix_group[:, perm]`` keeps at least as much
    magnitude under 2:4 pruning as ``matrix_group`` (see the module docstring). ``options``: ``strategy``
    (any of Apex's names; "user defined" returns the identity), ``improvement_threshold`` (1e-9),
    ``max_iterations``."""
    a = _as_matrix(matrix_group).abs()
    options = dict(options or {})
    strategy = options.get("strategy", "exhaustive")
    if strategy not in _STRATEGIES:
        raise ValueError(f"options['strategy'] must be one of {_STRATEGIES}, got {strategy!r}")
    cols = a.shape[1]
    perm = torch.arange(cols, device=a.device)
    if strategy == "user defined" or cols <= 4:
        return perm.tolist()
    threshold = float(options.get("improvement_threshold", 1e-9))
    max_iterations = int(options.get("max_iterations", 2 * cols))
    chunk = max(1, int(2**22 // max(1, a.shape[0] * cols)))
    stripe = torch.arange(cols, device=a.device) // 4
    same = stripe[:, None] == stripe[None, :]
    t1, t2 = _top2_of_others(a)
    rep = _replaced(t1, t2, a, chunk)  # rep[i, j]: stripe(i) with column j in i's place
    base = _kept(a.reshape(a.shape[0], -1, 4)).sum(0)
    for it in range(max_iterations):
        gain = rep + rep.t() - base[stripe][:, None] - base[stripe][None, :]
        gain = gain.masked_fill(same, float("-inf"))
        best = int(torch.argmax(gain))
        i, j = best // cols, best % cols
        if float(gain[i, j]) <= threshold:
            break
        if verbosity > 1:
            print(f"[permutation search] iteration {it}: swap columns {i} and {j}, gain {float(gain[i, j]):.6g}")
        perm[[i, j]] = perm[[j, i]]
        a[:, [i, j]] = a[:, [j, i]]
        # only the two stripes and the two columns involved change
        touched = torch.cat([torch.arange(4 * int(stripe[k]), 4 * int(stripe[k]) + 4, device=a.device)
                             for k in (i, j)])
        t1[:, touched], t2[:, touched] = _top2_of_others(a[:, touched])  # touched = two whole stripes
        rep[touched] = _replaced(t1[:, touched], t2[:, touched], a, chunk)
        rep[:, [i, j]] = _replaced(t1, t2, a[:, [i, j]], chunk)
        base[stripe[touched[::4]]] = _kept(a[:, touched].reshape(a.shape[0], 2, 4)).sum(0)
    return perm.tolist()
