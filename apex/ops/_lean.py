"""What the lean eager paths of the Triton path share (:mod:`apex.ops._bias_act_direct`,
:mod:`apex.ops._index_mul_direct`, :mod:`apex.ops._softmax_direct`): a table of launch plans per argument
layout, and the token that says whether the kernels' own plans still stand.

A plan stands for the checks of every call with its key, so a table lives in ``_tuning``'s plan caches: an
override or an assumed device empties it with the kernels' plans, whose configuration a plan holds.
"""

from __future__ import annotations

from apex._backend import _resolve
from apex._kernels import _tuning


class _NoPlan:
    key = None  # (equal to no key)


_NO_PLAN = _NoPlan()


class PlanTable:
    """The plans of one op, by key: a plan, or False for a key the Triton path does not run as a plan does
    (kept, so that the next such call goes to the general path at once)."""

    __slots__ = ("plans", "last")

    def __init__(self):
        self.plans, self.last = _tuning.plan_cache(), _tuning.plan_cache()

    def get(self, key: tuple, t) -> object:
        """The plan of ``key`` where the Triton path takes the call (``t``: the tensor whose device the backend
        reads); False where the general path must (not planned, another backend, the backend's error: the
        general path raises it, in its order); None for a key not seen yet."""
        # The last call's plan first: one comparison of the key instead of its hash and a comparison.
        plan = self.last.get(0, _NO_PLAN)
        if plan.key != key:
            plan = self.plans.get(key)
            if not plan:
                return plan
            self.last[0] = plan
        try:
            return plan if _resolve(plan.on_gpu, t) == "triton" else False
        except RuntimeError:
            return False

    def add(self, key: tuple, plan: object, t) -> object:
        """Keeps ``plan`` (or False) for ``key``, answered as :meth:`get` answers it."""
        if len(self.plans) >= 256:  # layouts that keep changing (variable batch or length): stay bounded
            self.plans.clear()
        self.plans[key] = plan
        return self.get(key, t) if plan else False


# One token while the kernels' launch plans stand: _tuning.invalidate (an override, an assumed device) empties
# this with them, so that a plan's kept backward launch is looked up again after it (a dict lookup of an int, not
# of the launch's key). Compare ``kept is not EPOCH.get(0) or kept is None``.
EPOCH = _tuning.plan_cache()


def epoch() -> object:
    """The current token (made if none)."""
    token = EPOCH.get(0)
    return token if token is not None else EPOCH.setdefault(0, object())
