"""The loss-scale update with hysteresis as one single-program Triton kernel (no host synchronisation)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _update_kernel(scale_ptr, growth_ptr, hyst_ptr, found_ptr, factors_ptr, growth_interval, hysteresis):
    f = tl.load(found_ptr)
    s = tl.load(scale_ptr)
    g = tl.load(growth_ptr)
    h = tl.load(hyst_ptr)
    pos = f > 0
    h1 = tl.where(pos, h - 1, h)
    early = pos & (h1 > 0)
    backoff = (~early) & (f != 0)
    grow = (~early) & (f == 0)
    successful = g + 1
    hit = grow & (successful == growth_interval)
    # Products in float64, one rounding to fp32, as the CUDA kernel does.
    grown = (s.to(tl.float64) * tl.load(factors_ptr)).to(tl.float32)
    shrunk = (s.to(tl.float64) * tl.load(factors_ptr + 1)).to(tl.float32)
    shrunk = tl.where(tl.abs(shrunk) < 1.1754943508222875e-38, 0.0, shrunk)  # subnormal -> 0, as Apex's kernel
    grown_ok = (grown == grown) & (tl.abs(grown) != float("inf"))
    new_s = tl.where(backoff, shrunk, tl.where(hit & grown_ok, grown, s))
    new_g = tl.where(early | backoff | hit, 0, tl.where(grow, successful, g))
    new_h = tl.where(f <= 0, hysteresis, h1)
    tl.store(scale_ptr, new_s)
    tl.store(growth_ptr, new_g)
    tl.store(hyst_ptr, new_h)


def update(scale: torch.Tensor, growth: torch.Tensor, hyst: torch.Tensor, found_inf: torch.Tensor,
           growth_factor: float, backoff_factor: float, growth_interval: int, hysteresis: int) -> None:
    # The factors travel as float64 so the products keep double precision (scalar arguments are fp32).
    factors = torch.tensor([growth_factor, backoff_factor], dtype=torch.float64).to(scale.device,
                                                                                    non_blocking=True)
    _update_kernel[(1,)](scale, growth, hyst, found_inf, factors, growth_interval, hysteresis)
