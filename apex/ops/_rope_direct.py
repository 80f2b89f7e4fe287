"""The lean eager path of ``fused_rope`` (``sbhd`` with ``freqs``) on the Triton path: a plan per argument
layout and one plain ``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether
``check_sbhd`` passes (it reads the input's rank, shape, dtype and device, the table's shape, dtype and
device), the output's layout (``transpose_output_memory``), the input's, output's and table's strides and the
kernels' launch plans (:func:`apex._kernels.fused_rope._plan`, by shape, dtype and device). :class:`Lean`
keeps a :class:`RopePlan` per key of every one of those facts (the input's shape, strides (True where
contiguous), dtype and device; the table's shape, strides, dtype and device; ``transpose_output_memory``): a
hit stands for the checks and launches the kernel the general launcher (:func:`apex._kernels.fused_rope.rope`,
mode 0) launches, with the same arguments (the same bits). A miss is checked first (the general path's
errors, in its order) and planned only where the Triton path runs the call itself: the quick check's usual
call (fp32 angles), not fp64 (the PyTorch path's), not empty. A key that is not planned is kept as False, so
that the next call goes to the general path at once.

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers (the registered op, as before), the backend (an ``apex.backend`` block or
``APEX_BACKEND`` may change it between calls), whether a gradient is needed (a table that requires one takes
the general path: its graph has the table as an input). The backward takes the registered op wherever it is
needed (a graph for a second derivative, a dispatch mode, a subclass gradient) and the general launcher for a
saved table a saved-tensor hook gave back with other strides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex._kernels import _tuning
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
_F32, _F64 = torch.float32, torch.float64
_LAST = _tuning.last
_FWD_OP, _BWD_OP = "fused_rope.fwd", "fused_rope.bwd"  # (apex._kernels.fused_rope._plan's names)


class RopePlan:
    """One layout's launches. ``dims``: the output's allocation (``[b, s, h, d]`` transposed to ``[s, b, h, d]``
    where ``tr``, else the input's shape); ``sf``: the table's strides (the backward compares its saved table's
    with them); ``fwd``: ``(launcher, arguments after x, y, table, warps, configuration)`` of the forward, filled
    at the first call the Triton path takes (no kernels loaded for a layout only the PyTorch path sees);
    ``sy``: the output's (and the gradient's) strides; ``bwd``: :meth:`backward_launch`'s, with the
    :data:`_EPOCH` it was looked up in (an override or an assumed device between a forward and its backward
    counts, as in the general launcher, which looks its plan up at each launch)."""

    __slots__ = ("key", "on_gpu", "dims", "tr", "r", "sf", "sy", "fwd", "bwd", "kernels", "general", "guards",
                 "guard_builds")

    def __init__(self, key: tuple, t: Tensor, r: int, tr: bool, kernels: Callable, general: Callable):
        self.key, self.on_gpu, self.tr, self.r, self.sf = key, t.is_cuda, tr, r, key[5]
        self.guards, self.guard_builds = [], 0
        s, b, h, d = t.shape
        self.dims = (b, s, h, d) if tr else (s, b, h, d)
        self.kernels, self.general = kernels, general
        self.fwd = self.bwd = self.sy = None

    def build(self, t: Tensor) -> None:
        """The forward's launch (the general launcher's, ``rope(t, y, 0, False, r, freqs, ..., (0, 3))``),
        from the key's facts: contiguous strides where the key says so (a contiguous tensor differs from them
        only along size-1 dims, where a stride addresses nothing: the same values)."""
        y = self.alloc(t)
        _, launch, B, H, D, bh, bd, warps, rounded, halves, _, cfg = self.kernels()._plan(t, False)
        sx = y.new_empty(t.shape).stride() if self.key[1] is True else self.key[1]
        self.sy = y.stride()
        sf = self.sf
        self.fwd = (launch, (B, H, D, self.r, *sx, *self.sy, sf[0], sf[3], False, rounded, bh, bd, halves),
                    warps, cfg)

    def alloc(self, t: Tensor) -> Tensor:
        """The output (or the gradient's) as the general path's ``_alloc`` makes it: contiguous, or
        ``[b, s, h, d]`` memory seen as ``[s, b, h, d]``."""
        y = t.new_empty(*self.dims)
        return y.transpose(0, 1) if self.tr else y

    def forward(self, t: Tensor, freqs: Tensor) -> Tensor:
        y = t.new_empty(*self.dims)
        if self.tr:
            y = y.transpose(0, 1)
        launch, args, warps, cfg = self.fwd
        _LAST[_FWD_OP] = cfg  # as a hit of the general launcher records it
        launch(t, y, freqs, *args, num_warps=warps)
        return y

    def backward_launch(self, g: Tensor) -> tuple:
        """``(epoch, launcher, arguments before and after the gradient's strides, those of a contiguous
        gradient, warps, configuration)`` of the backward now (its own kernel plan, looked up again as the
        general launcher does at each launch: its head block, warps and tile may differ from the forward's)."""
        _, launch, B, H, D, bh, bd, warps, rounded, halves, _, cfg = self.kernels()._plan(g, True)
        sf = self.sf
        head, tail = (B, H, D, self.r), (*self.sy, sf[0], sf[3], True, rounded, bh, bd, halves)
        self.bwd = (_epoch(), launch, head, tail, (*head, *g.new_empty(g.shape).stride(), *tail), warps, cfg)
        return self.bwd


class _DirectRope(torch.autograd.Function):
    """``apply(t, (plan, freqs))``: the plan's forward, saving the table; its backward, or the registered op
    wherever it is needed. The table (no gradient: the entry routes one that requires a gradient to the general
    path) travels in the tuple: an input tensor costs the C++ apply its bookkeeping."""

    @staticmethod
    def forward(ctx, t, args):
        plan, freqs = args
        ctx.save_for_backward(freqs)
        ctx.plan = plan
        y = t.new_empty(*plan.dims)  # (plan.forward, inline: a frame less; sizes as ints: a tuple costs its parse)
        if plan.tr:
            y = y.transpose(0, 1)
        launch, fargs, warps, cfg = plan.fwd
        _LAST[_FWD_OP] = cfg
        launch(t, y, freqs, *fargs, num_warps=warps)
        return y

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        (freqs,) = ctx.saved_tensors
        # The registered op wherever it is needed: a graph for a second derivative, a dispatch mode, a
        # torch.func transform, a tensor subclass, compiled autograd (exporting is compiling).
        if (_grad_enabled() or type(grad) not in _PLAIN or _is_compiling() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing()):
            return plan.general(grad, freqs, None, None, None, None, 0, 1, True, plan.tr), None
        # (grad has the output's shape, dtype and device: autograd's engine casts a gradient to its output's
        # metadata, and a hook may not change it)
        dt = grad.new_empty(*plan.dims)
        if plan.tr:
            dt = dt.transpose(0, 1)
        if freqs.stride() != plan.sf:  # a saved-tensor hook's copy in another layout: the general launcher
            plan.kernels().rope(grad, dt, 0, True, plan.r, freqs, None, None, None, None, 1, (0, 3))
            return dt, None
        epoch, launch, head, tail, bargs, warps, cfg = plan.bwd or _NO_BWD
        if epoch is not _EPOCH.get(0) or epoch is None:
            epoch, launch, head, tail, bargs, warps, cfg = plan.backward_launch(grad)
        else:
            _LAST[_BWD_OP] = cfg  # as a hit of the general launcher records it
        if not grad.is_contiguous():
            bargs = (*head, *grad.stride(), *tail)
        launch(grad, dt, freqs, *bargs, num_warps=warps)
        return dt, None


_NO_BWD = (None,) * 7  # (no backward launch kept yet)
_direct = super(torch.autograd.Function, _DirectRope).apply  # the C++ apply, as apex.ops._dispatch's


class Lean:
    """The plans of ``fused_rope`` and its eager entry: :meth:`run` answers the output, or None where the
    general path must take the call (having changed nothing). ``kernels``: the kernel module's getter;
    ``check``: ``check_sbhd``; ``general``: the registered op (``_rope_op``)."""

    def __init__(self, kernels: Callable, check: Callable, general: Callable):
        self.kernels, self.check, self.general = kernels, check, general
        self.table = PlanTable()

    def run(self, t: object, freqs: object, tr: object) -> Tensor | None:
        # First, before any lookup: what torch.compile, torch.export (which compiles), a dispatch mode, a
        # torch.func transform or a tracer sees is the general path (nothing planned under them).
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(t) not in _PLAIN or type(freqs) not in _PLAIN or type(tr) is not bool):
            return None  # (a subclass, not a tensor, a flag the general path converts: its checks and errors)
        if not _triton_takes(t.is_cuda, t):
            return None
        ts = (t, freqs)
        plan = self.table.last.get(0)
        # The last call's plan where this call has its options and its tensors pass the plan's guard (see
        # apex.ops._lean.refresh_guard), else the plan of the call's key.
        if plan is None or not (tr is plan.key[8]
                                and _guarded(plan, ts)):
            # A contiguous input's strides are implied by its shape: is_contiguous() costs less than stride().
            key = (t.shape, t.is_contiguous() or t.stride(), t.dtype, t.device, freqs.shape, freqs.stride(),
                   freqs.dtype, freqs.device, tr)
            plan = self.table.get(key)
            if plan is None:
                plan = self.table.keep(key, self._plan(key, t, freqs, tr))
            if not plan:
                return None
            _refresh_guard(plan, ts)
        if plan.fwd is None:
            plan.build(t)
        if _grad_enabled():
            if freqs.requires_grad:
                return None  # (the general path: its graph has the table as an input, given no gradient)
            if t.requires_grad:
                return _direct(t, (plan, freqs))
        return plan.forward(t, freqs)

    def _plan(self, key: tuple, t: Tensor, freqs: Tensor, tr: bool) -> RopePlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the Triton path
        would not run the call as a plan does (fp64 or not the quick check's usual call, empty)."""
        r = self.check(t, freqs)
        if r < 0 or t.dtype is _F64 or freqs.dtype is not _F32 or not t.numel():
            return False
        return RopePlan(key, t, r, tr, self.kernels, self.general)
