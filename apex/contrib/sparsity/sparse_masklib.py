"""Structured m:n sparsity masks (Apex's ``apex.contrib.sparsity.sparse_masklib``), vectorised in PyTorch.

A mask keeps ``n`` of every ``m`` consecutive weights along the input-channel (reduction) direction, the
layout NVIDIA's sparse tensor cores accelerate (2:4 for ``m4n2``). Patterns, by name:

- ``m4n2_1d``: in every group of 4 along a row keep the 2 largest magnitudes (``topk`` over the groups).
- ``m4n2_2d_greedy``: every 4x4 block keeps 8 weights, 2 per row and 2 per column (so the transposed weight
  used in the data-gradient GEMM is 2:4 as well): weights are visited from the largest magnitude down and
  kept while their row and column still have room. All blocks are processed at once; the 16-step visit is
  the only loop.
- ``m4n2_2d_best``: the same constraint, exhaustively: the 90 valid 4x4 patterns are scored against every
  block with one matrix product and the pattern keeping the largest total magnitude wins.

Dtype policy: scores are computed on ``|tensor|`` in float32 (float64 stays float64); the returned mask has
the input's dtype and device, 1 for kept and 0 for pruned weights. ``density`` is accepted for Apex's
signature and ignored, as in Apex (every pattern has density n/m).

Differences from Apex: ``m4n2_2d_best`` works (Apex's calls an undefined ``reshape_2d``); rows whose length is
not a multiple of m are padded, so the trailing partial group keeps up to n weights (1d), and rows/columns
outside whole 4x4 blocks stay dense (2d, as Apex's greedy); 5-d (Conv3d) weights are supported; an unknown
pattern raises ``ValueError`` instead of calling ``None``.
"""

from __future__ import annotations

import functools
import itertools

import torch

__all__ = [
    "create_mask",
    "fill",
    "reshape_1d",
    "compute_valid_1d_patterns",
    "compute_valid_2d_patterns",
    "mn_1d_best",
    "m4n2_1d",
    "mn_2d_greedy",
    "m4n2_2d_greedy",
    "mn_2d_best",
    "m4n2_2d_best",
]


def fill(x: torch.Tensor) -> float:
    """Fraction of non-zero entries of ``x``."""
    return float(torch.count_nonzero(x)) / x.numel()


def reshape_1d(matrix: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Size]:
    """``(h, w) -> (h * ceil(w/m), m)``, zero-padding each row to a multiple of ``m``; also returns the padded shape."""
    pad = (-matrix.shape[1]) % m
    if pad:
        matrix = torch.nn.functional.pad(matrix, (0, pad))
    return matrix.reshape(-1, m), matrix.shape


@functools.lru_cache(maxsize=8)
def _patterns_1d(m: int, n: int) -> torch.Tensor:
    rows = [[1.0 if i in keep else 0.0 for i in range(m)] for keep in itertools.combinations(range(m), n)]
    return torch.tensor(rows)


def compute_valid_1d_patterns(m: int, n: int) -> torch.Tensor:
    """All ``C(m, n)`` vectors of length ``m`` with exactly ``n`` ones, as a float ``(C(m,n), m)`` tensor."""
    return _patterns_1d(m, n).clone()


@functools.lru_cache(maxsize=8)
def _patterns_2d(m: int, n: int) -> torch.Tensor:
    rows = _patterns_1d(m, n)
    # every choice of one valid row pattern per block row, kept when no column has more than n ones
    idx = torch.cartesian_prod(*[torch.arange(rows.shape[0])] * m).reshape(-1, m)
    blocks = rows[idx]  # (k**m, m, m)
    valid = (blocks.sum(dim=1) <= n).all(dim=1)
    return blocks[valid].contiguous()


def compute_valid_2d_patterns(m: int, n: int) -> torch.Tensor:
    """All ``m x m`` 0/1 blocks with exactly ``n`` ones per row and at most ``n`` per column (90 for 4:2)."""
    return _patterns_2d(m, n).clone()


def _score_dtype(matrix: torch.Tensor) -> torch.dtype:
    return torch.float64 if matrix.dtype == torch.float64 else torch.float32


def _check_2d(matrix: torch.Tensor, m: int, n: int) -> None:
    if matrix.dim() != 2:
        raise ValueError(f"matrix must be 2-d, got shape {tuple(matrix.shape)}")
    if not 0 < n <= m:
        raise ValueError(f"need 0 < n <= m, got m={m}, n={n}")


def mn_1d_best(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Mask keeping the ``n`` largest magnitudes of every ``m`` consecutive entries of each row (int32)."""
    _check_2d(matrix, m, n)
    groups, padded = reshape_1d(matrix.detach().abs().to(_score_dtype(matrix)), m)
    keep = torch.topk(groups, n, dim=1).indices
    mask = torch.zeros(groups.shape, dtype=torch.int32, device=matrix.device).scatter_(1, keep, 1)
    return mask.view(padded)[:, : matrix.shape[1]].contiguous()


def m4n2_1d(mat: torch.Tensor, density: float) -> torch.Tensor:
    """2:4 mask along rows: the 2 largest magnitudes of every 4 consecutive elements (``density`` unused)."""
    return mn_1d_best(mat, 4, 2)


def _blocks(matrix: torch.Tensor, m: int) -> tuple[torch.Tensor, int, int]:
    """Whole ``m x m`` blocks of ``|matrix|`` as ``(blocks, m*m)`` (row-major inside a block) and the grid."""
    rb, cb = matrix.shape[0] // m, matrix.shape[1] // m
    a = matrix.detach()[: rb * m, : cb * m].abs().to(_score_dtype(matrix))
    return a.reshape(rb, m, cb, m).permute(0, 2, 1, 3).reshape(rb * cb, m * m), rb, cb


def _unblock(matrix: torch.Tensor, block_mask: torch.Tensor, m: int, rb: int, cb: int) -> torch.Tensor:
    mask = torch.ones(matrix.shape, dtype=torch.int32, device=matrix.device)
    inner = block_mask.reshape(rb, cb, m, m).permute(0, 2, 1, 3).reshape(rb * m, cb * m)
    mask[: rb * m, : cb * m] = inner.to(torch.int32)
    return mask


def mn_2d_greedy(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Greedy 2-d m:n mask: per ``m x m`` block, keep entries from the largest magnitude down while their
    row and column hold fewer than ``n`` kept entries (int32; entries outside whole blocks stay 1)."""
    _check_2d(matrix, m, n)
    blocks, rb, cb = _blocks(matrix, m)
    nb = blocks.shape[0]
    # stable sort so equal magnitudes are visited in index order, as a sequential greedy would
    order = torch.sort(blocks, dim=1, descending=True, stable=True).indices
    rows, cols = order // m, order % m
    row_count = torch.zeros(nb, m, dtype=torch.int64, device=matrix.device)
    col_count = torch.zeros_like(row_count)
    keep = torch.zeros(nb, m * m, dtype=torch.int32, device=matrix.device)
    for k in range(m * m):  # fixed-length visit over all blocks at once
        r, c = rows[:, k : k + 1], cols[:, k : k + 1]
        ok = (row_count.gather(1, r) < n) & (col_count.gather(1, c) < n)
        keep.scatter_(1, order[:, k : k + 1], ok.to(torch.int32))
        row_count.scatter_add_(1, r, ok.to(torch.int64))
        col_count.scatter_add_(1, c, ok.to(torch.int64))
    return _unblock(matrix, keep, m, rb, cb)


def m4n2_2d_greedy(mat: torch.Tensor, density: float) -> torch.Tensor:
    """2:4 in both directions of every 4x4 block, picked greedily by magnitude (``density`` unused)."""
    return mn_2d_greedy(mat, 4, 2)


def mn_2d_best(matrix: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Exhaustive 2-d m:n mask: per ``m x m`` block the valid pattern with the largest kept magnitude
    (``argmax(|blocks| @ patternsᵀ)``; int32; entries outside whole blocks stay 1)."""
    _check_2d(matrix, m, n)
    blocks, rb, cb = _blocks(matrix, m)
    patterns = _patterns_2d(m, n).reshape(-1, m * m).to(device=matrix.device, dtype=blocks.dtype)
    best = torch.argmax(blocks @ patterns.t(), dim=1)
    return _unblock(matrix, patterns[best], m, rb, cb)


def m4n2_2d_best(mat: torch.Tensor, density: float) -> torch.Tensor:
    """2:4 in both directions of every 4x4 block: the valid pattern keeping the most magnitude (``density``
    unused)."""
    return mn_2d_best(mat, 4, 2)


_PATTERNS = {"m4n2_1d": m4n2_1d, "m4n2_2d_greedy": m4n2_2d_greedy, "m4n2_2d_best": m4n2_2d_best}


def create_mask(tensor: torch.Tensor, pattern: str = "m4n2_1d", density: float = 0.5) -> torch.Tensor:
    """Sparsity mask for a weight, with the weight's dtype, device and shape.

    The pattern runs along the input-channel dimension: a 1-d tensor is one row; ``(K, C)`` linear weights
    use rows of C; convolution weights ``(K, C, *kernel)`` are laid out as ``(K * prod(kernel), C)`` rows.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    func = _PATTERNS.get(pattern) if isinstance(pattern, str) else None
    if func is None:
        raise ValueError(f"pattern must be one of {sorted(_PATTERNS)}, got {pattern!r}")
    shape = tensor.shape
    if tensor.dim() == 0 or tensor.dim() > 5:
        raise ValueError(f"tensor must have 1 to 5 dimensions, got shape {tuple(shape)}")
    t = tensor.detach()
    if t.dim() == 1:
        mask = func(t.reshape(1, -1), density).reshape(shape)
    elif t.dim() == 2:
        mask = func(t, density)
    else:
        # (K, C, *kernel) -> (*kernel, K, C) -> rows of C, as Apex lays out convolution weights
        k = t.dim() - 2
        perm = (*range(2, 2 + k), 0, 1)
        rows = t.permute(perm).reshape(-1, shape[1])
        mask = func(rows, density).reshape([shape[i] for i in perm])
        inv = [perm.index(i) for i in range(t.dim())]
        mask = mask.permute(inv).contiguous()
    return mask.to(tensor.dtype)
