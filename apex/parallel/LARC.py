"""LARC: layer-wise adaptive rate control wrapped around any ``torch.optim`` optimizer.

For each parameter ``p`` with gradient ``g`` (and the group's ``weight_decay`` ``wd`` and ``lr``), when
``‖p‖ != 0`` and ``‖g‖ != 0``::

    local_lr = trust_coefficient * ‖p‖ / (‖g‖ + wd * ‖p‖ + eps)
    factor   = min(local_lr / lr, 1)   if clip   (the effective rate is min(lr, local_lr))
             = local_lr                otherwise (the effective rate is lr * local_lr)
    g       <- (g + wd * p) * factor

and then the wrapped optimizer steps with its own weight decay switched off for that step (LARC has
applied it). Norms are computed in the parameter's dtype, as Apex does.
"""

from __future__ import annotations

import torch

from apex.ops._cpu_norms import ROW_ELEMENTS, long_norm


class LARC:
    """Wrap ``optimizer`` so that its ``step()`` uses LARC's per-parameter learning rates.

    Args:
        optimizer: the optimizer to wrap (``torch.optim`` or apex).
        trust_coefficient: the trust coefficient ``η`` of https://arxiv.org/abs/1708.03888.
        clip: ``True``: the rate is ``min(lr, local_lr)``; ``False``: ``lr * local_lr``.
        eps: added to the denominator for numerical stability.
    """

    def __init__(self, optimizer, trust_coefficient: float = 0.02, clip: bool = True, eps: float = 1e-8):
        if not hasattr(optimizer, "param_groups") or not hasattr(optimizer, "step"):
            raise TypeError(f"optimizer must be an optimizer with param_groups and step(), got "
                            f"{type(optimizer).__name__}")
        self.optim = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.clip = clip

    def __getstate__(self):
        return self.optim.__getstate__()

    def __setstate__(self, state):
        self.optim.__setstate__(state)

    @property
    def state(self):
        return self.optim.state

    def __repr__(self) -> str:
        return self.optim.__repr__()

    @property
    def param_groups(self):
        return self.optim.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optim.param_groups = value

    @property
    def defaults(self):
        return self.optim.defaults

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.optim.load_state_dict(state_dict)

    def zero_grad(self, *args, **kwargs) -> None:
        self.optim.zero_grad(*args, **kwargs)

    def add_param_group(self, param_group) -> None:
        self.optim.add_param_group(param_group)

    def step(self, closure=None):
        weight_decays = []
        with torch.no_grad():
            for group in self.optim.param_groups:
                weight_decay = group.get("weight_decay", 0)
                weight_decays.append(weight_decay)
                group["weight_decay"] = 0
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    param_norm = _norm(p.data)
                    grad_norm = _norm(p.grad.data)
                    if param_norm != 0 and grad_norm != 0:
                        adaptive_lr = self.trust_coefficient * param_norm / (
                            grad_norm + param_norm * weight_decay + self.eps)
                        if self.clip:
                            adaptive_lr = torch.clamp(adaptive_lr / group["lr"], max=1)
                        p.grad.data += weight_decay * p.data
                        p.grad.data *= adaptive_lr
        try:
            return self.optim.step(closure) if closure is not None else self.optim.step()
        finally:
            for group, wd in zip(self.optim.param_groups, weight_decays):
                group["weight_decay"] = wd


def _norm(t: torch.Tensor) -> torch.Tensor:
    """``torch.norm(t)``, row by row for a long CPU tensor, whose one-accumulator sum would lose accuracy
    (``apex.ops._cpu_norms``)."""
    if t.is_cpu and t.numel() > ROW_ELEMENTS:
        return long_norm(t).to(t.dtype)
    return torch.norm(t)


# ``from apex.parallel.LARC import LARC`` (Apex's spelling) and ``apex.parallel.LARC(...)`` both work:
# the package exposes the class under the module's name, so the class also answers ``.LARC``.
LARC.LARC = LARC
