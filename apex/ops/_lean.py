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
        """Keeps ``plan`` (or False) for ``key`` and answers it; a plan is the last one from then on."""
        plans = self.plans
        if len(plans) >= 256:  # layouts that keep changing (variable batch or length): stay bounded
            plans.clear()
        plans[key] = plan
        if plan:
            self.last[0] = plan
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


def _tensor_guard(tensors: tuple):
    """A C-level check that tensors have exactly the metadata of ``tensors`` (Python type, dispatch keys, dtype,
    device, sizes, strides, requires_grad): TorchDynamo's own guard of a compiled graph's tensors. None where this
    PyTorch has none."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:  # an older or a stripped build: keys do the work
        return None


def guarded(plan, tensors: tuple) -> bool:
    """Whether ``tensors`` (a call's, in the plan's order and number) pass one of ``plan.guards``."""
    guards = plan.guards
    return bool(guards) and (guards[0].check(*tensors) or len(guards) > 1 and guards[1].check(*tensors))


_GUARD_BUILDS = 16  # guards built for one plan before it keeps the ones it has


def refresh_guard(plan, tensors: tuple) -> None:
    """After a key lookup found ``plan`` for a call on ``tensors`` (the call's tensors, in a fixed order per
    plan): make one of ``plan.guards`` a guard they pass (first), so that the next such call can take the plan on
    one C call instead of building its key. A guard checks every fact of the tensors that a key holds and more
    (exact strides, requires_grad, dispatch keys: stricter, so that a call it refuses takes the key, as before).
    A plan keeps two (a layout called with and without gradients alternately, as in training and evaluation,
    or by layers whose inputs differ so) and builds at most :data:`_GUARD_BUILDS`."""
    guards = plan.guards
    if guards:
        if guards[0].check(*tensors):
            return
        if len(guards) > 1 and guards[1].check(*tensors):
            guards.reverse()
            return
    if plan.guard_builds >= _GUARD_BUILDS:
        return
    plan.guard_builds += 1
    guard = _tensor_guard(tensors)
    if guard is not None:
        plan.guards = [guard, *guards[:1]]


# One token while the kernels' launch plans stand: _tuning.invalidate (an override, an assumed device) empties
# this with them, so that a plan's kept backward launch is looked up again after it (a dict lookup of an int, not
# of the launch's key). Compare ``kept is not EPOCH.get(0) or kept is None``.
EPOCH = _tuning.plan_cache()


def epoch() -> object:
    """The current token (made if none)."""
    token = EPOCH.get(0)
    return token if token is not None else EPOCH.setdefault(0, object())
