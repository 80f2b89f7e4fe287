"""What the tests of the planned eager paths (``apex.ops._*_direct``) share: comparing a planned call with
the general path's, and recording launches."""

from __future__ import annotations

import torch


def same_tensors(a, b, strides: bool = True) -> None:
    """``a`` and ``b`` (tensors or Nones, pairwise): the same shapes, dtypes, strides (``strides``) and bits
    (NaN where the other has NaN: an out-of-range index's row)."""
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for p, q in zip(a, b):
        if p is None:
            assert q is None
            continue
        assert p.shape == q.shape and p.dtype == q.dtype, (p.shape, q.shape, p.dtype, q.dtype)
        assert not strides or p.stride() == q.stride(), (p.stride(), q.stride())
        torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)


def same_run(lean, general, strides: bool = True) -> None:
    """``lean``, ``general``: ``(output, [gradients])`` of one call on the planned and on the general path."""
    (ya, ga), (yb, gb) = lean, general
    same_tensors([ya, *ga], [yb, *gb], strides)
    assert len(ga) == len(gb)


def record_launches(monkeypatch, kernels) -> list:
    """Records every launch of the Triton ``kernels`` (grid, arguments with tensors as their layout, keywords)
    and runs nothing: what the planned and the general paths launch, compared as launches."""
    seen = []

    def run(*args, grid=None, warmup=False, **kwargs):
        seen.append((grid, tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a
                                 for a in args), kwargs))

    for k in kernels:
        monkeypatch.setattr(k, "run", run)
    return seen
