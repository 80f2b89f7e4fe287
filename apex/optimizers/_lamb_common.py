"""Checks shared by FusedLAMB, FusedMixedPrecisionLamb and FusedNovoGrad.

Every check of a step runs before anything is modified, so a failed step leaves parameters, state and
step counters as they were.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from apex._errors import RuntimeValueError
from apex._kernels._lists import Column, column
from apex.optimizers._base import _number, check_betas, check_non_negative
from apex.optimizers._plan import Bucket, Plan

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# A gradient that does not fit its parameter, or a parameter group spread over devices: a ValueError (bad
# input) that is also the RuntimeError of Apex's multi-tensor kernels (and PyTorch's) for such tensors. The
# class is apex._errors' pair; the former name stays importable from here.
ParamMismatchError = RuntimeValueError


def check_hyperparameters(*, lr, betas, eps, weight_decay, max_grad_norm=None, amsgrad=False,
                          name: str = "FusedLAMB") -> None:
    if amsgrad:
        raise RuntimeError(f"{name} does not support the AMSGrad variant.")
    check_non_negative(lr, "lr")
    check_non_negative(eps, "eps")
    check_betas(betas)
    check_non_negative(weight_decay, "weight_decay")
    if max_grad_norm is not None and not 0.0 < _number(max_grad_norm, "max_grad_norm"):
        raise ValueError(f"Invalid max_grad_norm: {max_grad_norm} (expected max_grad_norm > 0)")


def check_group_hyperparameters(optimizer: torch.optim.Optimizer, param_group: dict) -> None:
    """``check_hyperparameters`` for a group given to ``add_param_group`` (missing keys: the defaults; a
    key in neither, as for an optimizer built with empty defaults, is not checked)."""
    given = {k: param_group.get(k, optimizer.defaults.get(k)) for k in ("lr", "betas", "eps", "weight_decay")}
    for key in ("lr", "eps", "weight_decay"):
        if given[key] is not None:
            check_non_negative(given[key], key)
    if given["betas"] is not None:
        check_betas(given["betas"])


class GroupGrads(NamedTuple):
    """A param group's parameters that have a gradient, their gradients (laid out as the parameters), the set of their
    dtypes and their shapes."""

    params: list
    grads: list
    dtypes: frozenset
    shapes: list


def params_with_grads(optimizer: torch.optim.Optimizer, name: str,
                      dtypes=SUPPORTED_DTYPES) -> list[GroupGrads]:
    """For each param group, its parameters that have a gradient and their gradients (a contiguous copy
    of one laid out otherwise), after checking every one of them."""
    return [group_grads(name, gi, group, dtypes) for gi, group in enumerate(optimizer.param_groups)]


def group_grads(name: str, gi: int, group: dict, dtypes=SUPPORTED_DTYPES) -> GroupGrads:
    """:func:`params_with_grads` for one group (``gi``: its index, for the messages).

    The checks run as one list comprehension per property (a per-parameter loop of tests costs more than
    a small tensor's update); only when one fails does the per-parameter pass build the message."""
    allowed = frozenset(dtypes)
    params = group["params"]
    grads = [p.grad for p in params]
    if any(g is None for g in grads):
        ps = [p for p, g in zip(params, grads) if g is not None]
        gs = [g for g in grads if g is not None]
    else:
        ps, gs = list(params), grads
    p_dtypes = [p.dtype for p in ps]
    seen = frozenset(p_dtypes)
    shapes = [p.shape for p in ps]
    if params and not _fit(params, ps, gs, p_dtypes, seen, allowed, shapes):
        _diagnose_group(name, gi, params, allowed)
    # Each gradient laid out as its parameter (the kernels walk both, and the state, in memory order): a copy of
    # a gradient of other strides (channels_last parameters are not contiguous).
    if not (all([g.is_contiguous() for g in gs]) and all([p.is_contiguous() for p in ps])):
        gs = [g if g.stride() == p.stride() or g.numel() <= 1 else torch.empty_like(p).copy_(g)
              for p, g in zip(ps, gs)]
    return GroupGrads(ps, gs, seen, shapes)


def _fit(params: list, ps: list, gs: list, p_dtypes: list, seen: frozenset, allowed: frozenset,
         shapes: list) -> bool:
    """Every parameter of the group (``params``) of an allowed dtype and on one device, and every gradient
    (of the parameters ``ps`` that have one) strided, on that device, of its parameter's dtype and shape."""
    device = params[0].device
    if len(ps) < len(params):
        seen = frozenset([p.dtype for p in params])
    if not seen <= allowed or {p.device for p in params} != {device}:
        return False
    return not gs or ({g.device for g in gs} == {device} and {g.layout for g in gs} == {torch.strided}
                      and [g.dtype for g in gs] == p_dtypes and [g.shape for g in gs] == shapes)


def _diagnose_group(name: str, gi: int, params: list, dtypes) -> None:
    device = params[0].device
    for pi, p in enumerate(params):
        g = p.grad
        if p.dtype not in dtypes or p.device != device or (
                g is not None and (g.layout != torch.strided or g.dtype != p.dtype or g.shape != p.shape
                                   or g.device != device)):
            _diagnose(name, gi, pi, p, device, dtypes)
    raise AssertionError("a failed check that no parameter explains")  # pragma: no cover


def _diagnose(name: str, gi: int, pi: int, p: torch.Tensor, device, dtypes) -> None:
    where = f"param_groups[{gi}]['params'][{pi}]"
    if p.dtype not in dtypes:
        raise RuntimeError(f"{name} supports {', '.join(map(str, dtypes))} parameters; {where} is {p.dtype}")
    if p.device != device:
        raise ParamMismatchError(f"{name}: {where} is on {p.device} but the group's first parameter is on "
                                 f"{device}; a parameter group must live on one device")
    g = p.grad
    if g.layout != torch.strided:
        raise RuntimeError(f"{name} does not support sparse gradients, please consider SparseAdam instead")
    raise ParamMismatchError(
        f"{name}: the gradient of {where} is {g.dtype} {tuple(g.shape)} on {g.device} but the parameter is "
        f"{p.dtype} {tuple(p.shape)} on {p.device}")


def pack_state(workspace, states: list, key: str, tensors: list, params: list) -> list:
    """The state ``key`` of the small fp32 parameters kept as views of the workspace's packed buffer
    (``_cpu_packed.Packed``), which the CPU update then moves in one op: ``tensors`` (that state, in
    the parameters' order) with those replaced by the views, ``states`` (the parameters' state dicts)
    updated. Values are copied in on the first step and after a checkpoint is loaded.

    Only while every one of those ``params`` is contiguous, as the views are: a kernel that walks a parameter
    and its state in memory order (the Triton path, on CPU tensors too) needs them laid out alike, so a state
    whose parameter is not (channels_last) is its own tensor in the parameter's layout, taken out of the buffer
    if it was in it."""
    pk = workspace.packed()
    if not pk.index:
        return tensors
    if not all([params[i].is_contiguous() for i in pk.index]):
        tensors = list(tensors)
        for i in pk.index:
            t = tensors[i]
            if t._base is not None or t.stride() != params[i].stride():
                tensors[i] = states[i][key] = torch.empty_like(params[i], dtype=t.dtype).copy_(t)
        return tensors
    if pk.holds(key, [tensors[i] for i in pk.index]):
        return tensors
    tensors = pk.adopt(key, tensors)
    for i in pk.index:
        states[i][key] = tensors[i]
    return tensors


def lamb_bucket(plan: Plan, params: list, *states: list) -> Bucket:
    """One launch over all of a plan's parameters (of one dtype or several: LAMB's kernels group them) and
    their ``states`` (lists of state tensors in the parameters' order)."""
    dtype = plan.dtypes[0] if plan.dtypes.count(plan.dtypes[0]) == len(plan.dtypes) else None
    b = Bucket(None, dtype, params[0].device, plan.numels)
    b.lists = [b.column(params, plan.ptrs, dtype=dtype)] + [b.column(s) for s in states]
    return b


def all_grads(planned: list) -> Column | None:
    """The gradients of every group of a step (``step_plans``'s result) as one Column, or None without any:
    for the global gradient norm."""
    cols = [b.grads(gs, gptrs) for plan, gs, gptrs in planned for b in plan.buckets]
    if not cols:
        return None
    if len(cols) == 1:
        return cols[0]
    dtype = cols[0].dtype if all(c.dtype is cols[0].dtype for c in cols) else None
    device = cols[0].device if all(c.device == cols[0].device for c in cols) else None
    return column([t for c in cols for t in c], ptrs=[p for c in cols for p in c.ptrs],
                  numels=tuple(n for c in cols for n in c.numels), dtype=dtype, device=device)
