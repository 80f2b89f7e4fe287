"""Relative-error checks against float64 references.

The error of ``out`` against the reference ``ref`` is ``‖out − ref‖ / ‖ref‖`` (Frobenius norms, computed
in float64). For fp32 a fixed bound applies (``TOLERANCES``); for fp16/bf16 a test should also pass
``baseline``, the same computation done by plain PyTorch in that dtype, and ``out`` may then be at most
twice as far from the reference as the baseline (plus the fixed floor, so exact baselines do not demand
exactness).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Relative-error bound per dtype for a single elementwise or reduction result.
TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-12,
    torch.float32: 2e-6,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def to_float64(x):
    """Recursively convert tensors (in lists/tuples/dicts) to float64 copies."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64) if x.is_floating_point() else x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(to_float64(v) for v in x)
    if isinstance(x, dict):
        return {k: to_float64(v) for k, v in x.items()}
    return x


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``‖out − ref‖ / ‖ref‖`` in float64; ``‖out − ref‖`` alone when ``ref`` is zero."""
    o = out.detach().to(torch.float64).reshape(-1)
    r = ref.detach().to(torch.float64).reshape(-1)
    if o.shape != r.shape:
        raise ValueError(f"shapes differ: out {tuple(out.shape)} vs ref {tuple(ref.shape)}")
    diff = torch.linalg.vector_norm(o - r).item()
    den = torch.linalg.vector_norm(r).item()
    return diff / den if den > 0 else diff


def assert_rel_close(
    out: torch.Tensor | Sequence[torch.Tensor],
    ref: torch.Tensor | Sequence[torch.Tensor],
    dtype: torch.dtype | None = None,
    *,
    tol: float | None = None,
    baseline: torch.Tensor | Sequence[torch.Tensor] | None = None,
    name: str = "output",
) -> float:
    """Assert ``rel_error(out, ref) <= bound`` and return the error.

    ``bound`` is ``tol`` if given, else ``TOLERANCES[dtype]`` (dtype defaults to ``out``'s dtype); with a
    ``baseline`` it is ``max(bound, 2 * rel_error(baseline, ref))``. Lists are compared element by element.
    """
    if isinstance(out, (list, tuple)):
        if not isinstance(ref, (list, tuple)) or len(out) != len(ref):
            raise AssertionError(f"{name}: expected {len(ref) if isinstance(ref, (list, tuple)) else 1} "
                                 f"tensors, got {len(out)}")
        bases = baseline if baseline is not None else [None] * len(out)
        return max(assert_rel_close(o, r, dtype, tol=tol, baseline=b, name=f"{name}[{i}]")
                   for i, (o, r, b) in enumerate(zip(out, ref, bases)))
    dt = dtype if dtype is not None else out.dtype
    bound = tol if tol is not None else TOLERANCES.get(dt, 1e-6)
    if baseline is not None:
        bound = max(bound, 2.0 * rel_error(baseline, ref))
    if not torch.isfinite(out.detach().to(torch.float64)).all() and torch.isfinite(ref).all():
        raise AssertionError(f"{name}: non-finite values where the reference is finite")
    err = rel_error(out, ref)
    if not err <= bound:
        raise AssertionError(f"{name}: relative error {err:.3e} exceeds {bound:.3e} (dtype {dt})")
    return err


def rand(*shape: int, dtype: torch.dtype = torch.float32, device="cpu", generator=None,
         scale: float = 1.0) -> torch.Tensor:
    """Fresh normal random values (never zeros), drawn in fp32 then cast."""
    return (torch.randn(*shape, generator=generator, device=device) * scale).to(dtype)


def inject_nonfinite(tensors: Iterable[torch.Tensor], which: str = "inf", index: int = 0) -> None:
    """Write one ``inf``/``-inf``/``nan`` into the first tensor of ``tensors`` at flat ``index``."""
    value = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}[which]
    t = next(iter(tensors))
    t.view(-1)[index % t.numel()] = value
