"""The lean eager path of :class:`apex.parallel.SyncBatchNorm` on the Triton path: its plans and its autograd
Functions, for ``apex.parallel._syncbn_direct`` (which reads the module's state, launches and records these).

Almost everything such a call derives besides its tensors follows from the input's shape: whether the
argument checks pass (at least 2 dimensions, the channel count, a kernel dtype, a non-empty batch), the
``(N, C, L)`` sizes, and from those the kernels' :class:`~apex._kernels.sync_batch_norm.Plan` (layouts,
grids, workspaces, each kernel bound to its grid), kept in :data:`_PLANS` per ``(shape, dtype, channel_last,
num_features)``, every fact it derives from. It is the plan the general path's launchers use for the same
sizes, and the launches are its methods: the same kernels with the same arguments, the same results bit for
bit.

A :class:`SyncPlan` holds that plan for one argument layout: :func:`lookup`'s key adds the input's contiguity
and which of ``z``, the parameters and the buffers are absent. The facts of the other tensors the kernels need
(plain tensors on the input's device, contiguous; ``z`` of the input's shape) are checked at every call that
takes a key, never planned (``param.data = ...`` or ``Module.to`` changes them in place). A plan keeps a guard
of the tensors of such a call (``apex.ops._lean.refresh_guard``: one C call checks every tensor's type,
dispatch keys, dtype, device, sizes, strides and requires_grad, which covers those checks and the key's facts
of the input), so that a module's next call whose options equal the plan's and whose tensors pass one of its
guards takes the plan (:data:`HINTS`: the plan each module took last) with no key and no per-tensor check.

:class:`SyncBatchnormDirect` (and :class:`SyncBatchnormDirectZ`, with a residual ``z``) records a call whose
kernels ran: a tensor argument per differentiable input and one tuple for the rest, so that the C++ ``apply``
and the engine handle four (five) arguments instead of fifteen.

Each function here answers None where the general path must take the call, having changed nothing, so that
it raises its errors in its own order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from apex._kernels import _tuning
from apex.ops._lean import PlanTable
from apex.ops._lean import refresh_guard as _refresh_guard
from apex.ops.sync_batch_norm import _kernels

if TYPE_CHECKING:
    from apex._kernels.sync_batch_norm import Plan

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # fp64 takes PyTorch's path
_PLANS: dict = {}  # the kernels' plan (or None) per (shape, dtype, channel_last, num_features)
_TABLE = PlanTable()  # SyncPlans per lookup key
# The plan each module took last, by id(module): a hint only (a plan stands for any call whose options equal
# its own and whose tensors pass its guard, whatever the module), so that a model's layers of different
# shapes each find theirs without a key. Emptied with the kernels' plans (_tuning.invalidate) and when full.
HINTS = _tuning.plan_cache()
_Parameter, _Tensor = torch.nn.Parameter, torch.Tensor
Tensor = torch.Tensor


class SyncPlan:
    """One argument layout's launches: ``kp``, the kernels' plan of the input's ``(N, C, L)``; ``R``, the values
    per channel (``N * L``); ``contig``, whether the input is contiguous (the kernels read it as it is, else a
    contiguous copy). A call compares its options with ``channel_last``, ``num_features`` and ``form`` before
    trying the guards. ``form`` says which tensors are absent, and so which ones the guards check (the call's
    tensors in the order ``input, z, weight, bias, running_mean, running_var, num_batches_tracked``, the absent
    ones left out): 1 for all but ``z`` and the counter (eval mode), 2 for all but ``z`` (training), else the
    tuple of ``t is None`` over the six after the input."""

    __slots__ = ("key", "channel_last", "num_features", "form", "kp", "R", "contig", "guards", "guard_builds")

    def __init__(self, key: tuple, kp: Plan, contig: bool):
        self.key, self.kp, self.R, self.contig = key, kp, kp.R, contig
        self.channel_last, self.num_features, self.form = key[3:]
        self.guards, self.guard_builds = [], 0


def lookup(input: torch.Tensor, z: Tensor | None, weight: Tensor | None, bias: Tensor | None,
           running_mean: Tensor | None, running_var: Tensor | None, tracked: Tensor | None, channel_last: bool,
           num_features: int, form: object, ts: tuple) -> SyncPlan | None:
    """The plan of a call on ``input`` with these (None where absent; ``form`` and ``ts``, the call's tensors,
    as :class:`SyncPlan` has them), its guards refreshed, or None where the general path must take it: an input
    a check refuses or the kernels do not take (fp64, empty), or tensors they cannot read next to ``input``.
    The caller has asked the backend, and whether functorch transforms or a tracer are active."""
    contig = input.is_contiguous()
    key = (input.shape, input.dtype, contig, channel_last, num_features, form)
    p = _TABLE.get(key)
    if p is None:
        shape_key = (input.shape, input.dtype, channel_last, num_features)
        kp = _PLANS.get(shape_key, False)
        if kp is False:
            kp = _plan(shape_key)
        p = _TABLE.keep(key, SyncPlan(key, kp, contig) if kp is not None else False)
    if not p:
        return None
    # The kernels read these next to the input and contiguous: plain parameters and tensors, z of the input's
    # shape; anything else is the general path's (its error, or PyTorch's operators). Asked at every call that
    # builds a key, not planned: a parameter can be moved between calls (Module.to replaces its data in place)
    # or replaced. (A guard stands for these: it checks each tensor's type, device, strides and shape.)
    device = input.device
    if not ((weight is None or weight.__class__ is _Parameter and weight.device == device and weight.is_contiguous())
            and (bias is None or bias.__class__ is _Parameter and bias.device == device and bias.is_contiguous())
            and (running_mean is None or running_mean.__class__ is _Tensor and running_mean.device == device
                 and running_mean.is_contiguous() and running_var.__class__ is _Tensor
                 and running_var.device == device and running_var.is_contiguous())
            and (tracked is None or tracked.__class__ is _Tensor and tracked.device == device)
            and (z is None or z.__class__ is _Tensor and z.device == device and z.shape == input.shape)):
        return None
    _refresh_guard(p, ts)
    return p


def _plan(key: tuple) -> Plan | None:
    """The kernels' plan of a ``(shape, dtype, channel_last, num_features)`` not cached yet, computed and
    cached (None too: the general path's)."""
    shape, dtype, channel_last, num_features = key
    p = None
    dim = len(shape)
    if dim >= 2 and dtype in _FLOATS:
        last = bool(channel_last) or dim == 2
        C = shape[-1] if last else shape[1]
        numel = 1
        for s in shape:
            numel *= s
        if C == num_features and numel:  # the (N, C, L) of ops.ncl_sizes: the general path's plan
            p = _kernels().plan((numel // C, C, 1) if last else (shape[0], C, numel // (shape[0] * C)))
    if len(_PLANS) >= 1024:  # sizes that keep changing (variable batch or resolution): stay bounded
        _PLANS.clear()
    _PLANS[key] = p
    return p


class SyncBatchnormDirect(torch.autograd.Function):
    """``apply(input, weight, bias, (y, st, x, None, (plan, count, fuse_relu, group, distributed)))``, a call
    without ``z``: the forward's kernels ran in ``apex.parallel._syncbn_direct.module_forward`` (they update
    the running statistics, which are no inputs of the graph), so this forward hands ``y`` to autograd and
    saves what the backward reads; ``x`` is the contiguous input the kernels read, ``count`` is None where the
    running statistics normalised (``plan``: the kernels'). The backward is the general path's
    ``_fused_backward`` on the plan: the same launches."""

    @staticmethod
    def forward(ctx, input, weight, bias, meta):
        y, st, x, _, ctx.meta = meta  # (not y, st, x: the output kept by its own node would be a cycle)
        ctx.save_for_backward(x, weight, bias, st)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, weight, bias, st = ctx.saved_tensors
        if not (x.is_contiguous() and st.is_contiguous()):  # (as SyncBatchnormDirectZ's)
            x, st = x.contiguous(), st.contiguous()
        p, count, fuse_relu, group, distributed = ctx.meta
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        dy = grad_output.contiguous()
        grad_weight = torch.empty_like(weight) if need_w else None
        grad_bias = torch.empty_like(bias) if need_b else None
        ws = p.backward_sums(dy, x, None, st, fuse_relu, grad_weight, grad_bias)
        if not need_x:
            return None, grad_weight, grad_bias, None
        if count is not None and distributed:
            dist.all_reduce(ws[:2], group=group)
        return p.backward_elemt(dy, x, None, st, ws, count, fuse_relu, False)[0], grad_weight, grad_bias, None


class SyncBatchnormDirectZ(torch.autograd.Function):
    """:class:`SyncBatchnormDirect` with the residual: ``apply(input, z, weight, bias, (y, st, x, zz, (...)))``,
    ``zz`` the contiguous residual the kernels read."""

    @staticmethod
    def forward(ctx, input, z, weight, bias, meta):
        y, st, x, zz, ctx.meta = meta
        ctx.save_for_backward(x, zz, weight, bias, st)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, zz, weight, bias, st = ctx.saved_tensors
        if not (x.is_contiguous() and zz.is_contiguous() and st.is_contiguous()):
            # The kernels read the saved input, residual and statistics as the forward made them, contiguous; a
            # saved-tensor hook may give them back in another layout.
            x, zz, st = x.contiguous(), zz.contiguous(), st.contiguous()
        p, count, fuse_relu, group, distributed = ctx.meta
        need_x, need_z, need_w, need_b, _ = ctx.needs_input_grad
        dy = grad_output.contiguous()
        grad_weight = torch.empty_like(weight) if need_w else None
        grad_bias = torch.empty_like(bias) if need_b else None
        ws = p.backward_sums(dy, x, zz, st, fuse_relu, grad_weight, grad_bias)
        if not (need_x or need_z):
            return None, None, grad_weight, grad_bias, None
        if count is not None and distributed:
            dist.all_reduce(ws[:2], group=group)
        dx, dz = p.backward_elemt(dy, x, zz, st, ws, count, fuse_relu, need_z)
        return dx if need_x else None, dz, grad_weight, grad_bias, None


# The C++ apply: no Python wrapper unwrapping functorch's dead wrappers (no transform is active here).
direct_apply = super(torch.autograd.Function, SyncBatchnormDirect).apply
direct_apply_z = super(torch.autograd.Function, SyncBatchnormDirectZ).apply
