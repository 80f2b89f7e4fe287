"""Per-group step plans: what a fused optimizer's step reads of a parameter group, read once.

A step of a fused optimizer needs, per parameter group, the parameters that have a gradient, their state
tensors grouped into one multi-tensor launch per (dtype, ...) bucket, and checks of every gradient. Done
in Python for every parameter this costs microseconds per tensor, more than the GPU needs for the whole
update once there are thousands of tensors. A :class:`Plan` keeps all of that from the step that built it;
the next step only reads each parameter's gradient and the few facts that decide whether the plan still
holds, with one C-level pass per fact over the group (``map`` over the tensors, compared as tuples):

* the group's parameter list holds the same tensors (``add_param_group`` and ``load_state_dict`` drop
  every plan outright);
* each parameter still lives at the same address (``param.data = ...`` moves it);
* the same parameters have a gradient (a gradient set to None, or one that appears);
* every gradient has its parameter's dtype, number of elements and device index (``get_device``, an int:
  CPU and meta are both -1) and is contiguous (or has its parameter's strides).

Gradients are not kept between steps (``zero_grad(set_to_none=True)`` must free them), so a new gradient
tensor, the usual case, costs these reads and nothing else; its address goes into the launch's table, which
the engine reuses while the addresses repeat. The gradients a step checked are held by weak references, not
by their ids: a gradient that dies frees its id for the next tensor made, which may be a view of the same
memory in another layout (the gradient setter does not read strides).

When a fact differs, the optimizer checks the group as on the first step (with its error messages) and builds
a new plan. After the first step, a gradient given its parameter's number of elements in another shape behind
the setter's back (``grad.set_``, ``grad.data =``) is updated in flat order, as Apex's multi-tensor engine does
(it checks sizes). What the plan does not see: a tensor of ``optimizer.state[p]`` *replaced* by assignment
between steps (writing into it is seen by the kernels as usual); reload such a state with ``load_state_dict``.
"""

from __future__ import annotations

from itertools import compress, repeat
from operator import attrgetter, is_, is_not
from weakref import ref as _ref

import torch

from apex._kernels._lists import Column, column

_grad = attrgetter("grad")
_dtype = attrgetter("dtype")
_shape = attrgetter("shape")
_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_contiguous = torch.Tensor.is_contiguous
_device_index = torch.Tensor.get_device
_deref = _ref.__call__


_GUARD_BUILDS = 3  # rebuilds of a plan's guard (gradients that fit in another layout) before it is given up


def guard(tensors: list):
    """A C-level check that tensors have exactly the metadata of ``tensors`` now (Python type, dispatch keys,
    dtype, device, sizes, strides, requires_grad; each a distinct tensor), or None where PyTorch has none.

    It is the check TorchDynamo runs on the tensors a compiled graph takes (``TensorGuards``): one call reads
    what four passes of Python attribute reads would, in C. It is stricter than what a plan needs (sizes, not
    numbers of elements; strides even where contiguous), so a gradient it refuses is checked again in Python.
    """
    try:
        from torch._C._dynamo.guards import TensorGuards

        # (both keywords always: the constructor reads them from the keyword dict, which must exist)
        return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:  # an older or a stripped build: the Python checks do the work
        return None


class Plan:
    """The step of one parameter group, as built from the group's state by an optimizer.

    ``params``: the group's parameters when built; ``with_grad``: those that had a gradient, in order;
    ``buckets``: whatever the optimizer keeps per launch. The rest is what :meth:`grads` compares.
    """

    def __init__(self, params, with_grad):
        self.params = tuple(params)
        self.mask = tuple(map(is_not, map(_grad, self.params), repeat(None)))
        self.all_have_grads = all(self.mask)
        self.with_grad = tuple(with_grad)
        self.ptrs = tuple(map(_ptr, self.with_grad))
        self.dtypes = tuple(map(_dtype, self.with_grad))
        self.numels = tuple(map(_numel, self.with_grad))
        self.shapes = tuple(map(_shape, self.with_grad))
        self.devices = tuple(map(_device_index, self.with_grad))
        contiguous = tuple(map(_contiguous, self.with_grad))
        # Dense parameters that are not contiguous (channels_last): their gradients must have their strides.
        self.strided = tuple(i for i, c in enumerate(contiguous) if not c)
        self.strides = tuple(self.with_grad[i].stride() for i in self.strided)
        self.buckets: list = []
        self.watched: list = []
        self.grefs: tuple | None = None  # weak references to the gradients last checked at these addresses
        self.gref_builds = 0
        self.gptrs: tuple = ()
        self.guard = None  # guard() of gradients that fit: a new set with their metadata fits too
        self.guard_builds = 0

    def checked(self, gs: list, gptrs: tuple) -> None:
        """Gradients that passed the full checks (or the contiguous copies the checks made of them), at
        ``gptrs``: the guard of later ones. (Their ids are not taken: the next step checks its gradients.)"""
        self.guard, self.guard_builds = guard(gs), 1
        self.gptrs = gptrs  # the tuple the engine's tables were made with: later steps hand it on while it holds

    def watch(self, tensor: torch.Tensor) -> None:
        """Hold the plan only while ``tensor`` is not written from outside: call after each own write (a
        write through a view, e.g. of a packed step counter in the state, moves the version too)."""
        for pair in self.watched:
            if pair[0] is tensor:
                pair[1] = tensor._version
                return
        self.watched.append([tensor, tensor._version])

    def fits(self, gs: list) -> bool:
        """Whether the gradients ``gs`` (one per ``with_grad``) have their parameters' dtypes, sizes, device
        and layout, as the kernels require. Each fact is one C-level pass. Sizes, not shapes, as Apex's
        multi-tensor engine checks: PyTorch's gradient setter and autograd already refuse a gradient of another
        shape, and the number of elements is what decides which memory a kernel touches (a ``torch.Size`` read
        costs twice an int's). First, in one C call, whether they have exactly the metadata of gradients that
        fit earlier (:func:`guard`): the usual new gradients, made by autograd as the last ones were."""
        held = self.guard
        if held is not None and held.check(*gs):
            return True
        if not self._fits(gs):
            return False
        if self.guard_builds < _GUARD_BUILDS:  # they fit in another layout: check the next ones against it
            self.guard = guard(gs)
            self.guard_builds += 1
        return True

    def _fits(self, gs: list) -> bool:
        if tuple(map(_dtype, gs)) != self.dtypes or tuple(map(_numel, gs)) != self.numels:
            return False
        # (an int per tensor: a device index is read without making a torch.device)
        if tuple(map(_device_index, gs)) != self.devices:
            return False
        if not self.strided:
            return all(map(_contiguous, gs))
        return (all(gs[i].stride() == st for i, st in zip(self.strided, self.strides))
                and all(gs[i].is_contiguous() for i in range(len(gs)) if i not in self.strided))

    def grads(self, group_params) -> tuple[list, tuple] | None:
        """``(grads, their addresses)`` of the plan's parameters for this step, or None when the plan no
        longer describes the group (then nothing has been changed)."""
        params = self.params
        if len(group_params) != len(params) or not all(map(is_, group_params, params)):
            return None
        if not all(t._version == v for t, v in self.watched):
            return None
        gs = list(map(_grad, params))
        if not self.all_have_grads:
            if tuple(map(is_not, gs, repeat(None))) != self.mask:
                return None
            gs = list(compress(gs, self.mask))
        try:
            gptrs = tuple(map(_ptr, gs))  # (a gradient that is now None raises TypeError here)
            if tuple(map(_ptr, self.with_grad)) != self.ptrs:
                return None
            if gptrs == self.gptrs:
                gptrs = self.gptrs  # (the engine's caches compare an address tuple they hold by identity first)
                # The very gradient tensors checked at the last step, alive (a weak reference answers its own
                # object or None: never another one, as an id may), at the same addresses: checked then.
                # (a list compares its items by identity first; a dead reference's None is no tensor's equal)
                grefs = self.grefs
                if grefs is None or list(map(_deref, grefs)) != gs:
                    if not self.fits(gs):
                        return None
                    # Weak references to gradients that stay (accumulated into, not set to None): made twice at
                    # most, so that new tensors every step (which they never name again) cost only the guard.
                    if self.gref_builds < 2:
                        self.gref_builds += 1
                        self.grefs = tuple(map(_ref, gs))
                    else:
                        self.grefs = None
            elif self.fits(gs):
                self.grefs = None  # (new addresses are new tensors: referenced once the addresses repeat)
            else:
                return None
            self.gptrs = gptrs
        except (TypeError, RuntimeError, NotImplementedError):  # None, or sparse: the full checks say which
            return None
        return gs, gptrs


def step_plans(optimizer, mode: tuple, check, build, after_checks=None) -> list[tuple[Plan, list, tuple]]:
    """Per group of ``optimizer``, ``(plan, gradients, their addresses)`` for this step.

    ``optimizer._plans`` holds the plans; they are all dropped when ``mode`` (the options plans depend on),
    the state dict or its size changed. A group whose plan no longer holds is checked in full by
    ``check(gi, group)`` (which raises on bad input and returns an object with the group's ``params`` that
    have a gradient and their ``grads``); every group is checked (then ``after_checks()`` runs) before
    ``build(group, checked)`` makes any new plan, so a failed check changes nothing."""
    plans = optimizer.__dict__.setdefault("_plans", {})
    state = optimizer.state
    held = plans.get("mode")  # the state dict (by identity), its size, the options
    if held is None or held[0] is not state or held[1] != len(state) or held[2] != mode:
        plans.clear()
    found: list = []
    stale: dict = {}
    for gi, group in enumerate(optimizer.param_groups):
        entry = plans.get(id(group))
        got = entry[1].grads(group["params"]) if entry is not None and entry[0] is group else None
        if got is None:
            stale[gi] = check(gi, group)
        found.append(None if got is None else (entry[1],) + got)
    if stale:
        if after_checks is not None:
            after_checks()
        for gi, checked in stale.items():
            relayout_state(state, checked.params)
            group = optimizer.param_groups[gi]
            plan = build(group, checked)
            plans[id(group)] = (group, plan)
            found[gi] = (plan, list(checked.grads), tuple(map(_ptr, checked.grads)))
            plan.checked(found[gi][1], found[gi][2])
        plans["mode"] = (optimizer.state, len(optimizer.state), mode)
    return found


def relayout_state(state, params) -> None:
    """Lays each state tensor of ``params`` (``state``: ``optimizer.state``) that has its parameter's shape but
    not its strides out as the parameter is, in place (``.data``: the tensor stays the one the state, the
    masters' lists and the caller hold). The kernels walk a parameter, its gradient and its state in memory
    order, so they must agree; they part where ``model.to(memory_format=...)`` re-lays the parameters after
    the state was made, or where a checkpoint's state is loaded into a model of another memory format.
    Views are left alone: the CPU path keeps small tensors' state as views of one packed buffer (element-wise,
    in the parameters' logical order)."""
    for p in params:
        st = state.get(p)
        if not st or p.is_contiguous() and all(v.is_contiguous() for v in st.values() if type(v) is torch.Tensor):
            continue
        shape, stride = p.shape, p.stride()
        for v in st.values():
            if (type(v) is torch.Tensor and v.shape == shape and v.numel() > 1 and v.stride() != stride
                    and v._base is None):
                v.data = torch.empty_like(p, dtype=v.dtype, device=v.device).copy_(v)


def take(xs, idx: list | None) -> list:
    """``xs`` at the positions ``idx`` (None: all of them), as a list."""
    return list(xs) if idx is None else [xs[i] for i in idx]


class Bucket:
    """One multi-tensor launch of a plan: ``idx``, the positions of its parameters among the plan's
    ``with_grad`` (None: all of them), their one ``dtype`` (also the gradients'), ``device`` and sizes, and
    the optimizer's Columns of parameters and state in ``lists``."""

    def __init__(self, idx: list | None, dtype: torch.dtype, device: torch.device, numels: tuple):
        self.idx, self.dtype, self.device, self.numels = idx, dtype, device, numels
        self.lists: list = []

    def column(self, tensors, ptrs=None, dtype: torch.dtype | None = None) -> Column:
        """A Column of tensors sized like this bucket's parameters (dtype read when not given)."""
        return column(tensors, ptrs=ptrs, numels=self.numels, dtype=dtype, device=self.device)

    def grads(self, gs: list, gptrs: tuple) -> Column:
        """This step's gradients of the bucket, from the plan's checked ones."""
        if self.idx is not None:
            gs, gptrs = take(gs, self.idx), take(gptrs, self.idx)
        return column(gs, ptrs=gptrs, numels=self.numels, dtype=self.dtype, device=self.device)

    def held_tables(self, gs: list, gptrs: tuple, make_tables) -> list:
        """The tables of a launch the step makes itself over this step's gradients and the bucket's lists:
        held while the gradients' addresses are those of the last step (the plan hands that same tuple on while
        the addresses repeat) or of the step before (as when each step's new gradients take the memory the
        one before last freed: compared as tuples, which differ early when they differ). Otherwise a held
        table of all the bucket's tensors is copied with the gradients' new addresses (one upload), else
        ``make_tables(grads)`` (with the bucket's Column of gradients; the kernels' ``tables``, whose engine
        caches them by a hash of every address) makes them. (The plan has checked that the gradients have
        their parameters' dtype, sizes and device; every engine table lists the gradients first.)"""
        held = self.__dict__.get("tables")
        if held is not None:
            if held[0] is gptrs:
                return held[1]
            prev = self.__dict__.get("prev_tables")
            if prev is not None and prev[0] == gptrs:
                self.prev_tables, self.tables = held, (gptrs, prev[1])
                return prev[1]
            if len(held[1]) == 1:
                tab = held[1][0]
                ptrs = gptrs if self.idx is None else take(gptrs, self.idx)
                if tab.n_tensors == len(ptrs) and tab.host is not None:
                    from apex._kernels.multi_tensor import with_first_list  # (imports Triton: not at import)

                    tabs = [with_first_list(tab, ptrs)]
                    self.prev_tables, self.tables = held, (gptrs, tabs)
                    return tabs
        tabs = make_tables(self.grads(gs, gptrs))
        self.prev_tables, self.tables = held, (gptrs, tabs)
        return tabs
