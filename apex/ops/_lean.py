"""What the lean eager paths of the Triton path share (the ``apex.ops._*_direct`` modules): whether the Triton
path takes a call (asked first), a table of launch plans per argument layout, the exact form of a shape
argument in a key, and the token that says whether the kernels' own plans still stand.

A plan stands for the checks of every call with its key, so a table lives in ``_tuning``'s plan caches: an
override or an assumed device empties it with the kernels' plans, whose configuration a plan holds.
"""

from __future__ import annotations

import torch

from apex._backend import _resolve
from apex._kernels import _tuning


class _NoPlan:
    key = None  # (equal to no key)


_NO_PLAN = _NoPlan()


def triton_takes(on_gpu: bool, t) -> bool:
    """Whether the Triton path takes a call on ``t`` now (``on_gpu``: ``t.is_cuda``): the backend, asked at every
    call (an ``apex.backend`` block or ``APEX_BACKEND`` may change it between calls) and before a plan's key is
    built, so that another backend's call (the CPU's default) pays for no key and never plans (a plan may need
    the kernel module, and Triton is an optional dependency). A backend's error is the general path's to raise,
    after its checks."""
    try:
        return _resolve(on_gpu, t) == "triton"
    except RuntimeError:
        return False


class PlanTable:
    """The plans of one op, by key: a plan, or False for a key the Triton path does not run as a plan does
    (kept, so that the next such call goes to the general path at once). Keys are made and looked up only where
    :func:`triton_takes` the call."""

    __slots__ = ("plans", "last")

    def __init__(self):
        self.plans, self.last = _tuning.plan_cache(), _tuning.plan_cache()

    def get(self, key: tuple) -> object:
        """The plan of ``key``, False where the general path must take such calls, None for a key not seen."""
        # The last call's plan first: one comparison of the key instead of its hash and a comparison.
        plan = self.last.get(0, _NO_PLAN)
        if plan.key != key:
            plan = self.plans.get(key)
            if plan:
                self.last[0] = plan
        return plan

    def keep(self, key: tuple, plan: object) -> object:
        """Keeps ``plan`` (or False) for ``key`` and answers it."""
        plans = self.plans
        if len(plans) >= 256:  # layouts that keep changing (variable batch or length): stay bounded
            plans.clear()
        plans[key] = plan
        return plan


_SIZE = torch.Size


def exact_shape(shape: object) -> object:
    """``shape`` as a plan's key holds it (an int, a ``torch.Size``, or a tuple of ints), or None where it is
    none of those exactly: a sequence holding ``4.0`` (equal to ``4``, and hashed alike) or a subclass must not
    take the plan of ``4``; the general path checks it (its errors)."""
    kind = type(shape)
    if kind is int or kind is _SIZE:  # (a Size holds ints)
        return shape
    if kind is not tuple and kind is not list:
        return None
    for s in shape:
        if type(s) is not int:
            return None
    return shape if kind is tuple else tuple(shape)


# One token while the kernels' launch plans stand: _tuning.invalidate (an override, an assumed device) empties
# this with them, so that a plan's kept backward launch is looked up again after it (a dict lookup of an int, not
# of the launch's key). Compare ``kept is not EPOCH.get(0) or kept is None``.
EPOCH = _tuning.plan_cache()


def epoch() -> object:
    """The current token (made if none)."""
    token = EPOCH.get(0)
    return token if token is not None else EPOCH.setdefault(0, object())
