"""The lean eager path of ``index_mul_2d`` on the Triton path: a plan per argument layout and one plain
``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether the
checks pass (``_check`` reads each tensor's dtype, rank, sizes and device), the row views the kernels read
(``_rows``: a unit feature stride, else a contiguous copy), the row strides and the launch plans of
:mod:`apex._kernels.index_mul_2d`. :class:`Lean` keeps a :class:`MulPlan` per key of every one of those facts
(``in1``'s and ``in2``'s shapes, strides, dtypes and devices, ``idx1``'s shape, dtype and device): a hit
stands for the checks and launches what the general launchers launch (``launch_gather``/``launch_segment``,
the same arguments: the same bits). A miss is checked first (the general path's errors, in its order) and
planned only where the Triton path runs it: a kernel dtype (not fp64), no empty dimension. A key that is not
planned is kept as False.

Asked at every call, not planned: ``idx1``'s values and its int64 form and stable sort (the op's
:class:`~apex.ops.index_mul_2d.IndexOrders`, which keeps them while that tensor is unchanged), tensor
subclasses, ``torch.compile``, ``torch.func`` transforms, dispatch modes and tracers (the general path), the
backend and whether a gradient is needed. The backward takes the general code for a second derivative
(``create_graph``), a subclass gradient, or saved inputs a saved-tensor hook gave back with other strides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C import _any_requires_grad, _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex.ops._dispatch import _PLAIN
from apex.ops._lean import PlanTable
from apex.ops._lean import guarded as _guarded
from apex.ops._lean import refresh_guard as _refresh_guard
from apex.ops._lean import triton_takes as _triton_takes

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class MulPlan:
    """One layout's launches: ``in1`` ``[R, F]``, ``in2`` ``[M, F]``; ``s1``, ``s2`` their full strides, or True
    where contiguous (the backward compares its saved inputs' with them); ``copy1``, ``copy2``: whether the
    kernels read a contiguous copy (a feature stride other than 1, as ``_rows``); ``sa``, ``sb``: the row
    strides read; ``gp``, ``sp``: the kernels' gather and segment-sum plans."""

    __slots__ = ("key", "on_gpu", "R", "M", "F", "s1", "s2", "copy1", "copy2", "sa", "sb", "gp", "sp", "k",
                 "general", "guards", "guard_builds")

    def __init__(self, key: tuple, in1: Tensor, in2: Tensor, kernels, general: Callable):
        self.key = key
        self.guards, self.guard_builds = [], 0
        (R, F), M = in1.shape, in2.shape[0]
        self.on_gpu, self.R, self.M, self.F = in1.is_cuda, R, M, F
        # True (the key's) for a contiguous input, read at the strides its shape implies: (F, 1), which may differ
        # from its own only along a size-1 dim (where a stride addresses nothing).
        self.s1, self.s2 = key[1], key[5]
        s1 = (F, 1) if self.s1 is True else self.s1
        s2 = (F, 1) if self.s2 is True else self.s2
        self.copy1, self.copy2 = s1[1] != 1, s2[1] != 1
        self.sa, self.sb = F if self.copy1 else s1[0], F if self.copy2 else s2[0]
        self.gp, self.sp = kernels.plan(M, F, False), kernels.plan(R, F, True)
        self.k, self.general = kernels, general

    def forward(self, in1: Tensor, in2: Tensor, idx: Tensor) -> Tensor:
        out = in2.new_empty(self.M, self.F)
        self.k.launch_gather(self.gp, in1.contiguous() if self.copy1 else in1,
                             in2.contiguous() if self.copy2 else in2, idx, out, self.R, self.M, self.F, self.sa,
                             self.sb)
        return out


class _DirectMul(torch.autograd.Function):
    """``apply(in1, in2, (idx, plan, ordered, perm))``: the plan's forward, saving the inputs and the int64 index
    (as the general Function does: an in-place change of any is autograd's error at the backward) and, on the
    context, the plan and the index's stable sort (which ``IndexOrders`` keeps anyway); its backward, or the
    general Function's (``plan.general``) for a second derivative, a subclass gradient or saved inputs with
    other strides. The index (no gradient) travels in the tuple: an input tensor costs the C++ apply its
    bookkeeping, and it is saved all the same."""

    @staticmethod
    def forward(ctx, in1, in2, args):
        idx, plan, ordered, perm = args
        ctx.save_for_backward(in1, in2, idx)
        ctx.args = (plan, ordered, perm)  # (not idx: saved, it follows saved-tensor hooks)
        out = in2.new_empty(plan.M, plan.F)  # (plan.forward, inline: a frame less)
        plan.k.launch_gather(plan.gp, in1.contiguous() if plan.copy1 else in1, in2.contiguous() if plan.copy2 else in2,
                             idx, out, plan.R, plan.M, plan.F, plan.sa, plan.sb)
        return out

    @staticmethod
    def backward(ctx, grad):
        in1, in2, idx = ctx.saved_tensors
        plan, ordered, perm = ctx.args
        s1, s2 = plan.s1, plan.s2
        if (_grad_enabled() or type(grad) not in _PLAIN
                or not (in1.is_contiguous() if s1 is True else in1.stride() == s1)
                or not (in2.is_contiguous() if s2 is True else in2.stride() == s2)):
            return (*plan.general(grad, in1, in2, idx, (ordered, perm)), None)
        # plan.backward, inline (a frame less): the gradient's rows as _rows makes them (itself where its feature
        # stride is 1), the segment sum of g·in2 and in1[idx]·g in one pass.
        sg = grad.stride()
        if sg[1] != 1:
            grad, sg = grad.contiguous(), (plan.F, 1)
        d1, d2 = in2.new_empty(plan.R, plan.F), in2.new_empty(plan.M, plan.F)
        plan.k.launch_segment(plan.sp, grad, in2.contiguous() if plan.copy2 else in2, perm, ordered, d1,
                              in1.contiguous() if plan.copy1 else in1, d2, plan.R, plan.M, plan.F, sg[0], plan.sb,
                              plan.sa)
        return d1, d2, None


_direct = super(torch.autograd.Function, _DirectMul).apply  # the C++ apply, as apex.ops._dispatch's


class Lean:
    """The plans of the op and its eager entry: :meth:`run` answers the output, or None where the general path
    must take the call (having changed nothing). ``kernels``: the kernel module's getter; ``check``: the op's
    ``_check`` (without the range check: the Triton path reads no index on the host); ``idx64``: the index as
    the kernels read it (int64, contiguous); ``general``: the backward of the general Function on ``(grad, in1,
    in2, idx, order)``."""

    def __init__(self, kernels: Callable, check: Callable, idx64: Callable, general: Callable):
        self.kernels, self.check, self.idx64, self.general = kernels, check, idx64, general
        self.table = PlanTable()

    def run(self, in1: object, in2: object, idx1: object, orders) -> Tensor | None:
        """``orders``: the op's ``IndexOrders`` (its module's, read at each call as the general path reads it)."""
        # First, before any lookup: what torch.compile, a dispatch mode, a torch.func transform or a tracer sees is
        # the general path (nothing planned under them).
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(in1) not in _PLAIN or type(in2) not in _PLAIN or type(idx1) not in _PLAIN):
            return None  # (a subclass, or not a tensor: the general path, its checks and errors)
        if not _triton_takes(in2.is_cuda, in2):
            return None
        ts = (in1, in2, idx1)
        plan = self.table.last.get(0)
        # The last call's plan where this call's tensors pass the plan's guard (see apex.ops._lean.refresh_guard),
        # else the plan of the call's key.
        if plan is None or not _guarded(plan, ts):
            # A contiguous input's strides are implied by its shape (see MulPlan): is_contiguous() costs less than
            # stride().
            key = (in1.shape, in1.is_contiguous() or in1.stride(), in1.dtype, in1.device, in2.shape,
                   in2.is_contiguous() or in2.stride(), in2.dtype, in2.device, idx1.shape, idx1.dtype, idx1.device)
            plan = self.table.get(key)
            if plan is None:
                plan = self.table.keep(key, self._plan(key, in1, in2, idx1))
            if not plan:
                return None
            _refresh_guard(plan, ts)
        if _grad_enabled() and _any_requires_grad(in1, in2):
            idx, ordered, perm = orders.get(idx1)  # (the backward's order, kept while idx1 is unchanged)
            return _direct(in1, in2, (idx, plan, ordered, perm))
        return plan.forward(in1, in2, self.idx64(idx1))

    def _plan(self, key: tuple, in1: Tensor, in2: Tensor, idx1: Tensor) -> MulPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the Triton
        path would not run the call as a plan does (fp64, an empty dimension)."""
        self.check(in1, in2, idx1, bounds=False)
        plan: MulPlan | bool = False
        if in1.dtype in _KERNEL_DTYPES and in1.numel() and in2.numel():
            plan = MulPlan(key, in1, in2, self.kernels(), self.general)
        return plan
