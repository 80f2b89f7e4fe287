"""The loss scalers of Apex's legacy ``fp16_utils`` API.

:class:`DynamicLossScaler`: start at ``init_scale`` (2**32); on overflow divide by ``scale_factor`` (2),
never below 1; every ``scale_window`` (1000) iterations since the last overflow multiply by
``scale_factor``. The overflow check reduces every gradient to one flag on the device and reads it once.
"""

from __future__ import annotations

import torch

from apex.fp16_utils.fp16util import to_python_float  # noqa: F401  (Apex exposes it here too)


def _any_nonfinite(tensors) -> bool:
    tensors = [t for t in tensors if t is not None]
    if not tensors:
        return False
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    flags = []
    for group in groups.values():
        # max |x| is inf or NaN exactly when some element is; one device reduction per dtype group.
        norms = torch._foreach_norm(group, float("inf"))
        flags.append(torch.stack([n.float() for n in norms]).isfinite().all().logical_not().reshape(1))
    return bool(torch.cat([f.to(flags[0].device) for f in flags]).any().item())


class _ScalerBase:
    """What both scalers share: the scale ``cur_scale`` and the scaled backward."""

    cur_scale: float

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_gradient(self, module, grad_in, grad_out):
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss, retain_graph: bool = False) -> None:
        scaled_loss = loss * self.loss_scale
        scaled_loss.backward(retain_graph=retain_graph)


class LossScaler(_ScalerBase):
    """A static loss scale (``FP16_Optimizer(static_loss_scale=...)``)."""

    def __init__(self, scale: float = 1):
        self.cur_scale = scale

    def has_overflow(self, params) -> bool:
        return False

    @staticmethod
    def _has_inf_or_nan(x) -> bool:
        return False

    def update_scale(self, overflow: bool) -> None:
        pass


class DynamicLossScaler(_ScalerBase):
    """Dynamic loss scale: halve on overflow (not below 1), double after ``scale_window`` clean iterations."""

    def __init__(self, init_scale: float = 2 ** 32, scale_factor: float = 2.0, scale_window: int = 1000):
        if scale_window is None or int(scale_window) <= 0:
            raise ValueError(f"scale_window must be a positive int, got {scale_window!r}")
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = int(scale_window)

    def has_overflow(self, params) -> bool:
        return _any_nonfinite([p.grad.data if p.grad is not None else None for p in params])

    @staticmethod
    def _has_inf_or_nan(x) -> bool:
        return _any_nonfinite([x])

    def update_scale(self, overflow: bool) -> None:
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
