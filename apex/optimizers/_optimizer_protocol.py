"""What every apex optimizer shares with ``torch.optim``'s protocol, whether or not it derives from
:class:`apex.optimizers._base.FusedOptimizerBase`: the ``step`` wrapper (``no_grad`` and step hooks), ``zero_grad``
honouring ``set_grad_none``, the closure, and copies / pickles that keep the constructor's attributes."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch.optim import optimizer as _torch_optimizer


def fused_step(func: Callable) -> Callable:
    """Decorator for a fused optimizer's ``step``: gradients off (``torch.no_grad``) and ``torch.optim``'s
    step hooks, as ``torch.optim.Optimizer`` wraps every ``step``; the profiler's ``Optimizer.step#...``
    range is opened only while a profiler runs (entering it costs as much as a step of ~100 parameters).
    With any step hook registered the call goes through PyTorch's own wrapper, unchanged."""

    @functools.wraps(func)
    def no_grad(*args, **kwargs):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            return func(*args, **kwargs)
        finally:
            torch._C._set_grad_enabled(prev)

    hooked = torch.optim.Optimizer.profile_hook_step(no_grad)

    @functools.wraps(func)
    def step(self, *args, **kwargs):
        if (self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks
                or _torch_optimizer._global_optimizer_pre_hooks or _torch_optimizer._global_optimizer_post_hooks
                or torch._C._autograd._profiler_enabled()):
            return hooked(self, *args, **kwargs)
        return no_grad(self, *args, **kwargs)

    step.hooked = True  # torch.optim.Optimizer.__init__ then leaves it as it is
    return step


def trusted(op) -> dict:
    """``validate=False`` for apex's own ops (the step already checked every tensor); nothing for an op a
    subclass swapped in."""
    return {"validate": False} if getattr(op, "__module__", "").startswith("apex.ops.") else {}


def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool | None) -> None:
    """Clear gradients: ``None`` when ``set_to_none`` (default: the optimizer's ``set_grad_none``), else
    zeros."""
    if set_to_none is None:
        set_to_none = optimizer.set_grad_none
    torch.optim.Optimizer.zero_grad(optimizer, set_to_none=bool(set_to_none))


def run_closure(closure: Callable | None):
    """``closure()`` with gradients enabled (``step`` runs under ``no_grad``), or None."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


# Caches an optimizer rebuilds on use: left out of its pickled state.
_CACHES = ("_workspace", "_packed_steps", "_overflow_bufs", "_pending_masters", "_plans")


class CopyableOptimizer(torch.optim.Optimizer):
    """``torch.optim.Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``, so
    a ``copy.deepcopy`` or a pickle of an optimizer would lose every attribute its constructor set (the
    copy fails at its first step). This keeps them all but the hooks (which PyTorch leaves out too) and
    the caches."""

    def __getstate__(self) -> dict:
        # Also left out: what amp.initialize attached (its stash, and methods bound to this object, which
        # a pickle cannot restore); the copy is the optimizer as constructed, as with torch.optim.
        return {k: v for k, v in self.__dict__.items()
                if not k.startswith(("_optimizer_", "_amp_")) and k not in _CACHES
                and not (isinstance(v, types.MethodType) and v.__self__ is self)}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for key in _CACHES:
            self.__dict__.setdefault(key, {})
        self._plans = {}

    # A step plan (apex.optimizers._plan) describes the param groups and state as they were: both of these
    # change them.
    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        self._plans = {}

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._plans = {}

