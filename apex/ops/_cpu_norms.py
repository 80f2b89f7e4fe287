"""Per-tensor norms on the PyTorch path, accurate for long tensors.

PyTorch's L2 norm on the CPU (``torch.linalg.vector_norm``, ``torch._foreach_norm``) adds a whole tensor
into one fp32 accumulator per vector lane, so its relative error grows with the tensor's length: about
1e-7 at 64K elements, 1e-5 at 1M, 4e-4 at 10M and 2e-3 at 30M. A tensor longer than ``ROW_ELEMENTS`` is
therefore normed as rows of that length, each as accurate as a short tensor, whose norms are combined
(a few thousand of them at most, with the same small error): about 1e-7 at any length, as with the
per-chunk partial sums of the Triton kernels and of Apex's CUDA ones. The max norm is exact anyway.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ROW_ELEMENTS = 1 << 15


def row_norms(x2: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.linalg.vector_norm(x2, dim=-1, dtype=dtype)`` of a 2-D tensor whose rows may be long: on
    the CPU a row longer than ``ROW_ELEMENTS`` is normed in pieces of that length, combined."""
    n = x2.shape[-1]
    if n <= ROW_ELEMENTS or not x2.is_cpu:
        return torch.linalg.vector_norm(x2, 2.0, dim=-1, dtype=dtype)
    k = n // ROW_ELEMENTS
    pieces = torch.linalg.vector_norm(x2[:, :k * ROW_ELEMENTS].reshape(x2.shape[0], k, ROW_ELEMENTS), 2.0,
                                      dim=-1, dtype=dtype)
    if n > k * ROW_ELEMENTS:
        tail = torch.linalg.vector_norm(x2[:, k * ROW_ELEMENTS:], 2.0, dim=-1, dtype=dtype)
        pieces = torch.cat([pieces, tail.unsqueeze(-1)], dim=-1)
    return torch.linalg.vector_norm(pieces, 2.0, dim=-1)


def long_norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``x`` accumulated in fp32 (0-dim), in pieces (see the module docstring)."""
    return row_norms(x.reshape(1, -1))[0]


def fp32_norms(xs: Sequence[torch.Tensor], ord: float = 2.0, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """``‖x_i‖`` (``ord`` 2 or inf) accumulated in fp32, as one 1-D fp32 tensor: one
    ``torch._foreach_norm`` call, with ``long_norm`` for the L2 norms of long CPU tensors. ``sizes``: the
    tensors' numels, when the caller has them."""
    long = []
    if ord == 2.0 and xs and xs[0].is_cpu:
        sizes = list(map(torch.Tensor.numel, xs)) if sizes is None else sizes
        if max(sizes) > ROW_ELEMENTS:
            long = [i for i, n in enumerate(sizes) if n > ROW_ELEMENTS]
    if not long:
        return torch.stack(torch._foreach_norm(xs, ord, dtype=torch.float32))
    out = torch.empty(len(xs), dtype=torch.float32)
    if len(long) < len(xs):
        is_long = set(long)
        short = [i for i in range(len(xs)) if i not in is_long]
        out[short] = torch.stack(torch._foreach_norm([xs[i] for i in short], ord, dtype=torch.float32))
    for i in long:
        out[i] = long_norm(xs[i])
    return out
