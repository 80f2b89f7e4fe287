"""``update_scale_hysteresis``: the loss-scale update with hysteresis used by Megatron-LM and NeMo.

``update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_factor,
backoff_factor, growth_interval, hysteresis)`` updates the three state tensors in place and returns
``current_scale``. With ``f = found_inf[0]``, ``s``, ``g``, ``h`` the scale, growth and hysteresis trackers:

* ``f > 0``: ``h -= 1``; if ``h > 0`` still, only ``g = 0`` (the scale is kept: hysteresis absorbs the
  overflow); otherwise ``s *= backoff_factor`` and ``g = 0``.
* ``f == 0``: ``g += 1``; when ``g == growth_interval``, ``s *= growth_factor`` unless that overflows fp32,
  and ``g = 0``; then ``h = hysteresis``.

Products are formed in float64 and rounded once to fp32, as the CUDA kernel does; a backed-off scale
that would be subnormal is flushed to zero, as Apex's kernel (built with fast math) gives it. On GPUs everything stays
on the device (no host synchronisation); CPU tensors are read directly. Dtypes: ``current_scale`` and
``found_inf`` float32, the trackers int32, one element each.
"""

from __future__ import annotations

import torch

from apex import _backend

_TINY = torch.finfo(torch.float32).tiny  # the smallest normal fp32


def _check_scalar(t, name: str, dtype: torch.dtype) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a one-element {dtype} tensor, got {type(t).__name__}")
    if t.dtype != dtype or t.numel() != 1:
        raise ValueError(f"{name} must be a one-element {dtype} tensor, got {t.dtype} with "
                         f"{t.numel()} elements")


def update_scale_hysteresis(current_scale: torch.Tensor, growth_tracker: torch.Tensor,
                            hysteresis_tracker: torch.Tensor, found_inf: torch.Tensor, growth_factor: float,
                            backoff_factor: float, growth_interval: int, hysteresis: int) -> torch.Tensor:
    """``amp_C.update_scale_hysteresis``: Megatron's dynamic loss-scale update with hysteresis.

    On ``found_inf`` the hysteresis counter drops, and once it reaches zero the scale is multiplied by
    ``backoff_factor``; after ``growth_interval`` clean steps the scale is multiplied by ``growth_factor``
    and the counter is reset to ``hysteresis``. Updates the tensors in place and returns ``current_scale``.
    """
    _check_scalar(current_scale, "current_scale", torch.float32)
    _check_scalar(growth_tracker, "growth_tracker", torch.int32)
    _check_scalar(hysteresis_tracker, "hysteresis_tracker", torch.int32)
    _check_scalar(found_inf, "found_inf", torch.float32)
    devices = {t.device for t in (current_scale, growth_tracker, hysteresis_tracker, found_inf)}
    if len(devices) != 1:
        raise ValueError(f"current_scale, growth_tracker, hysteresis_tracker and found_inf must be on one "
                         f"device, got {sorted(str(d) for d in devices)}")
    for name, v in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    for name, v in (("growth_factor", growth_factor), ("backoff_factor", backoff_factor)):
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{name} must be a number, got {type(v).__name__}")
    if _backend.select(current_scale) == "triton":
        from apex._kernels import update_scale_hysteresis as kernels

        kernels.update(current_scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor),
                       float(backoff_factor), int(growth_interval), int(hysteresis))
        return current_scale
    args = (current_scale, growth_tracker, hysteresis_tracker, found_inf, float(growth_factor),
            float(backoff_factor), int(growth_interval), int(hysteresis))
    if current_scale.device.type == "cpu":
        _update_cpu(*args)  # reading a CPU tensor is no synchronisation: plain scalar logic is fastest
    else:
        _update_torch(*args)
    return current_scale


@torch.no_grad()
def _update_cpu(scale, growth, hyst, found_inf, growth_factor, backoff_factor, growth_interval,
                hysteresis) -> None:
    f, s, g, h = found_inf.item(), scale.item(), int(growth.item()), int(hyst.item())
    if f > 0:
        h -= 1
        if h > 0:
            growth.fill_(0)
            hyst.fill_(h)
            return
    if f:
        shrunk = torch.tensor(s * backoff_factor, dtype=torch.float64).float()  # one rounding to fp32
        scale.fill_(0.0 if shrunk.abs() < _TINY else shrunk.item())  # subnormal -> 0 (Apex's fast math)
        g = 0
    else:
        g += 1
        if g == growth_interval:
            grown = torch.tensor(s * growth_factor, dtype=torch.float64).float()
            if torch.isfinite(grown):
                scale.fill_(grown.item())
            g = 0
    growth.fill_(g)
    hyst.fill_(hysteresis if f <= 0 else h)


@torch.no_grad()
def _update_torch(scale, growth, hyst, found_inf, growth_factor, backoff_factor, growth_interval,
                  hysteresis) -> None:
    f = found_inf.reshape(1)
    s, g, h = scale.reshape(1), growth.reshape(1), hyst.reshape(1)
    pos = f > 0
    h1 = torch.where(pos, h - 1, h)
    early = pos & (h1 > 0)                      # overflow absorbed by hysteresis
    backoff = ~early & (f != 0)                 # the kernel tests `if (*found_inf)`: any non-zero value
    grow = ~early & (f == 0)
    successful = g + 1
    hit = grow & (successful == growth_interval)
    grown = (s.double() * growth_factor).float()
    shrunk = (s.double() * backoff_factor).float()
    shrunk = torch.where(shrunk.abs() < _TINY, torch.zeros_like(shrunk), shrunk)
    new_s = torch.where(backoff, shrunk, torch.where(hit & torch.isfinite(grown), grown, s))
    zero = torch.zeros_like(g)
    new_g = torch.where(early | backoff | hit, zero, torch.where(grow, successful, g))
    new_h = torch.where(f <= 0, torch.full_like(h, hysteresis), h1)
    scale.copy_(new_s.reshape(scale.shape))
    growth.copy_(new_g.reshape(growth.shape))
    hyst.copy_(new_h.reshape(hyst.shape))
