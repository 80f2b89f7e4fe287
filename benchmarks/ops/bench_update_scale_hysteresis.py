"""update_scale_hysteresis: the sync-free update against the Python fallback Megatron/NeMo use without
amp_C (branches on ``found_inf.item()``, one host sync per step)."""

import amp_C
import torch

from benchmarks._harness import Case, Counted


def _state():
    return (torch.tensor([65536.0]), torch.zeros(1, dtype=torch.int32), torch.full((1,), 2, dtype=torch.int32),
            torch.zeros(1))


def _python_fallback(scale, growth, hyst, found, growth_factor=2.0, backoff_factor=0.5, interval=1000,
                     hysteresis=2):
    if found.item() > 0:
        hyst -= 1
        if hyst.item() <= 0:
            scale.mul_(backoff_factor)
        growth.zero_()
    else:
        growth += 1
        if growth.item() == interval:
            scale.mul_(growth_factor)
            growth.zero_()
        hyst.fill_(hysteresis)


def _timed():
    s, g, h, f = _state()
    s2, g2, h2, f2 = _state()
    return (lambda: amp_C.update_scale_hysteresis(s, g, h, f, 2.0, 0.5, 1000, 2),
            lambda: _python_fallback(s2, g2, h2, f2))


def _counted():
    s, g, h, f = _state()
    s2, g2, h2, f2 = _state()
    return Counted(triton=lambda: amp_C.update_scale_hysteresis(s, g, h, f, 2.0, 0.5, 1000, 2),
                   eager=lambda: _python_fallback(s2, g2, h2, f2), bytes_min=4 * 4,
                   note="distinct addresses: the 4 state scalars, plus the two float64 factors (16 bytes)")


def cases():
    return [Case("update_scale_hysteresis", timed=_timed, counted=_counted, torch_label="python .item() branch")]
