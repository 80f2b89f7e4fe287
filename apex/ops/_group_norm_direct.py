"""The lean eager path of ``group_norm`` on the Triton path: a plan per argument layout and one plain
``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether the
checks pass (``check_args`` reads the input's rank, channels, dtype and device, ``num_groups``, each
parameter's presence, shape, dtype and device, and ``act``), whether the kernels take the call (the input's
dtype, the group's channel count), the input's layout (``_layout``: itself in NCHW or NHWC, else a contiguous
copy), the strides of its ``[N, C, S]`` view and the kernels' launch plan (``apex._kernels.group_norm.Plan``).
:class:`Lean` keeps a :class:`GroupNormPlan` per key of every one of those facts: the input's shape, strides
(True where contiguous: the view's strides then follow from the shape), dtype and device; ``num_groups`` (an
exact ``int``: ``True == 1`` would share its key, and a bool is the checks' error); ``act`` (None or a str);
each parameter's shape, dtype and device. A hit stands for the checks and launches through the same ``Plan``
methods the general launchers call, with the same arguments: the same bits. A miss is checked first (the
general path's errors, in its order) and planned only where the Triton kernels run the call: fp32/fp16/bf16,
not empty, a group of at most ``MAX_GROUP_CHANNELS`` channels. A key that is not planned is kept as False.

The parameters' facts are read at every call: ``param.data = ...`` changes a parameter's dtype, device or shape
without changing the parameter or its version. ``eps`` is no fact of a plan (``float(eps)`` at each call).

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers (they take the registered op, as before), the backend (an
``apex.backend`` block or ``APEX_BACKEND`` may change it between calls; a miss under another backend keeps
nothing, and imports no Triton) and whether a gradient is needed. The backward takes the registered backward op
wherever it is needed (a graph for a second derivative, a dispatch mode, a subclass gradient), and the general
dispatch function for a saved input a saved-tensor hook gave back with other strides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C import _any_requires_grad, _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex.ops._dispatch import _PLAIN
from apex.ops._lean import EPOCH as _EPOCH
from apex.ops._lean import PlanTable
from apex.ops._lean import epoch as _epoch
from apex.ops._lean import guarded as _guarded
from apex.ops._lean import refresh_guard as _refresh_guard
from apex.ops._lean import triton_takes as _triton_takes

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class GroupNormPlan:
    """One argument layout's launches. ``copy``: the input is laid out by a contiguous copy (what the forward
    saves); ``sx``: the laid-out input's strides, or True where it is contiguous (the backward compares its saved
    input's, and the gradient's, with them); ``sn, sc, ss``: its ``[N, C, S]`` view's strides; ``kp``: the
    kernels' plan of the forward; ``bwd``: the backward's, with the :data:`_EPOCH` it was looked up in (looked up
    again after a change of ``LIMITS``, an override or an assumed device, as the general launcher would);
    ``general``: ``(registered backward op, backward dispatch on checked arguments)``."""

    __slots__ = ("key", "on_gpu", "num_groups", "silu", "act", "copy", "sx", "sn", "sc", "ss", "size", "kp", "bwd",
                 "kernels", "general", "guards", "guard_builds", "n_tensors")

    def __init__(self, key: tuple, input: Tensor, x: Tensor, num_groups: int, silu: bool, kernels, general: tuple):
        n, ch = input.shape[:2]
        s = input.numel() // (n * ch)
        self.key, self.on_gpu, self.kernels, self.general = key, input.is_cuda, kernels, general
        self.guards, self.guard_builds, self.n_tensors = [], 0, 1 if len(key) == 6 else 3
        self.num_groups, self.silu, self.act = num_groups, silu, "silu" if silu else ""
        self.copy = x is not input
        self.sx = True if self.copy or key[1] is True else key[1]
        self.sn, self.sc, self.ss = kernels.view_strides(x, ch, s)
        self.size = (n, num_groups, ch // num_groups, s)
        self.kp = kernels.plan(*self.size)
        self.bwd = (_epoch(), self.kp)

    def forward(self, input: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> tuple:
        """``(y, mean, rstd)`` as the general path's ``_forward_checked`` makes them."""
        return self.kp.forward(input.contiguous() if self.copy else input, self.sn, self.sc, self.ss, weight, bias,
                               eps, self.silu)


class _PlannedGroupNorm(torch.autograd.Function):
    """``apply(input, weight, bias, plan, eps)``: the plan's forward, saving what the registered op's autograd
    saves; its backward, or the registered backward op wherever that is needed."""

    @staticmethod
    def forward(ctx, input, weight, bias, plan, eps):
        x = input.contiguous() if plan.copy else input
        y, mean, rstd = plan.kp.forward(x, plan.sn, plan.sc, plan.ss, weight, bias, eps, plan.silu)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        x, weight, bias, mean, rstd = ctx.saved_tensors
        sx = plan.sx
        # The registered op wherever it is needed: a graph for a second derivative (its error), a subclass
        # gradient, compiled autograd (exporting is compiling), a dispatch mode, a torch.func transform, a tracer.
        if (_grad_enabled() or type(dy) not in _PLAIN or _is_compiling() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing()):
            dx, dw, db = plan.general[0](dy, x, mean, rstd, plan.num_groups, weight, bias, plan.act)
        elif not (x.is_contiguous() if sx is True else x.stride() == sx):
            # (a saved-tensor hook's copy in another layout: the general path lays it out and reads its strides)
            dx, dw, db = plan.general[1](dy, x, mean, rstd, plan.num_groups, weight, bias, plan.silu)
        else:
            if not (dy.is_contiguous() if sx is True else dy.stride() == sx):
                dy = torch.empty_like(x).copy_(dy)  # (the general path's copy: the kernels read dy with x's strides)
            epoch, kp = plan.bwd
            if epoch is not _EPOCH.get(0) or epoch is None:
                kp = plan.kernels.plan(*plan.size)
                plan.bwd = (_epoch(), kp)
            dx, dw, db = kp.backward(dy, x, plan.sn, plan.sc, plan.ss, weight, bias, mean, rstd, plan.silu)
        return dx, dw if weight is not None else None, db if bias is not None else None, None, None


_direct = super(torch.autograd.Function, _PlannedGroupNorm).apply  # the C++ apply, as apex.ops._dispatch's


class Lean:
    """The plans of ``group_norm`` and its eager entry: :meth:`run` answers the output, or None where the
    general path must take the call (having changed nothing). ``kernels``: the kernel module's getter;
    ``check``: ``check_args``; ``layout``: ``_layout``; ``general``: ``(_bwd_op, _backward_checked)``."""

    def __init__(self, kernels: Callable, check: Callable, layout: Callable, general: tuple):
        self.kernels, self.check, self.layout, self.general = kernels, check, layout, general
        self.table = PlanTable()

    def run(self, input: object, num_groups: object, weight: object, bias: object, eps: object,
            act: object) -> Tensor | None:
        # First, before any lookup: what torch.compile, torch.export (which compiles: see apex.ops._norm.prepare),
        # a dispatch mode, a torch.func transform or a tracer sees is the general path (nothing planned under them).
        # A subclass, not a tensor, a num_groups or act of another type: the general path, its checks and errors.
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(input) not in _PLAIN or type(num_groups) is not int
                or act is not None and type(act) is not str):
            return None
        if not _triton_takes(input.is_cuda, input):
            return None
        if weight is None or bias is None:
            if weight is not bias:  # (one of them: the checks' error)
                return None
            ts = (input,)
        elif type(weight) not in _PLAIN or type(bias) not in _PLAIN:
            return None
        else:
            ts = (input, weight, bias)
        table = self.table
        plan = table.last.get(0)
        # The last call's plan where this call has its options and its tensors pass the plan's guard (see
        # apex.ops._lean.refresh_guard), else the plan of the call's key.
        if plan is None or not (num_groups == plan.key[4] and act == plan.key[5] and len(ts) == plan.n_tensors
                                and _guarded(plan, ts)):
            # Every fact the checks read; a contiguous input's strides are implied by its shape (is_contiguous()
            # costs less than stride()). A parameter's facts are read each call (``param.data = ...``).
            if weight is None:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, input.device, num_groups,
                       act)
            else:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, input.device, num_groups,
                       act, weight.shape, weight.dtype, weight.device, bias.shape, bias.dtype, bias.device)
            if plan is None or plan.key != key:  # (PlanTable.get inline: a frame fewer)
                plan = table.plans.get(key)
                if plan is None:
                    plan = table.keep(key, self._plan(key, input, num_groups, weight, bias, act))
                if not plan:
                    return None
                table.last[0] = plan
            _refresh_guard(plan, ts)
        if _grad_enabled() and _any_requires_grad(input, weight, bias):
            return _direct(input, weight, bias, plan, float(eps))
        return plan.forward(input, weight, bias, float(eps))[0]

    def _plan(self, key: tuple, input: Tensor, num_groups: int, weight: Tensor | None, bias: Tensor | None,
              act: str | None) -> GroupNormPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the Triton kernels
        would not run the call (fp64 and other dtypes, an empty input, groups wider than the kernels)."""
        silu = self.check(input, num_groups, weight, bias, act)
        if input.dtype not in _KERNEL_DTYPES or not input.numel():
            return False
        kernels = self.kernels()
        if not kernels.supported(input.shape[1] // num_groups):
            return False
        return GroupNormPlan(key, input, self.layout(input), num_groups, silu, kernels, self.general)
