"""The lean eager path of ``bias_gelu`` and ``bias_swiglu`` on the Triton path: a plan per input layout and one
plain ``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether the
checks pass (``check_args`` reads the input's rank, width and dtype, the bias's shape, dtype and device),
the kernels' ``[M, N]`` sizes, the input's row and column strides (its 2-D row view, the general path's
``rows``), the outputs' sizes and the kernels' launch plans. :class:`Lean` keeps an :class:`ActPlan` per key
of every one of those facts (the input's shape, strides, dtype and device; the bias's shape, dtype and device,
or None): a hit stands for the checks, and launches the kernels the general path's launchers launch (the same
``Plan``/``Tiles`` methods, the same arguments: the same bits). A miss is checked first (the general
path's errors, in its order) and planned only where the Triton path runs the call itself: not fp64 (the
PyTorch path's), not empty, and an input whose rows are a view (else ``rows`` copies it). A key that is not
planned is kept as False, so that the next call goes to the general path at once.

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers (they take the registered op, as before), the backend (an
``apex.backend`` block or ``APEX_BACKEND`` may change it between calls) and whether a gradient is needed.
The backward takes the registered backward ops wherever those need them (a graph for a second derivative, a
dispatch mode, a subclass gradient), and the general dispatch functions for a saved input a saved-tensor hook
gave back with other strides.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C import _any_requires_grad, _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex._kernels import _tuning
from apex.ops._dispatch import _PLAIN, _PLAIN_OR_NONE
from apex.ops._lean import EPOCH as _EPOCH
from apex.ops._lean import PlanTable
from apex.ops._lean import epoch as _epoch
from apex.ops._lean import guarded as _guarded
from apex.ops._lean import refresh_guard as _refresh_guard
from apex.ops._lean import triton_takes as _triton_takes

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_F64 = torch.float64
_LAST = _tuning.last


class ActPlan:
    """One input layout's launches. ``dims``: the output's sizes, ``in_dims`` the input's (the gradient's);
    ``sx``: the input's full strides, or True for a contiguous input (the backward compares its saved input's
    with them); ``sx0, sx1``: its row view's (``(n, 1)`` where contiguous: a contiguous tensor may hold any
    stride along a size-1 dim, where it addresses nothing); ``nout``: the output's last dim (a contiguous
    gradient's row stride); ``two_d``: the input is its own row view. ``kp``: the kernels' plan of the forward
    (gelu: of every launch); ``glu``: SwiGLU (whose backward launches are planned by ``_tuning`` per direction,
    looked up at each backward as the general launchers do, so that an override or an assumed device between a
    forward and its backward counts: ``bwd`` and ``db`` keep them with the :data:`_EPOCH` they were looked up
    in)."""

    __slots__ = ("glu", "on_gpu", "dims", "in_dims", "sx", "sx0", "sx1", "nout", "two_d", "M", "N", "nb", "kp",
                 "fwd_op", "bwd_key", "db_key", "planned", "bwd", "db", "general", "key", "guards", "guard_builds")

    def __init__(self, key: tuple, glu: bool, input: Tensor, rows: Tensor, general: tuple):
        kernels = general[0]()
        self.key = key
        self.guards, self.guard_builds = [], 0
        shape = input.shape
        n = shape[-1]
        self.glu, self.on_gpu, self.general = glu, input.is_cuda, general
        self.M, self.N = input.numel() // n, n // 2 if glu else n
        self.nout = self.N
        self.in_dims = tuple(shape)
        self.dims = (*shape[:-1], self.N) if glu else self.in_dims
        self.sx = key[1]  # (the key's: True, or the strides)
        self.sx0, self.sx1 = (n, 1) if self.sx is True else rows.stride()
        self.two_d = input.dim() == 2
        self.nb = n  # the bias gradient's size
        if glu:
            key = (input.element_size(), input.get_device())
            self.fwd_op = kernels.FWD
            self.kp = kernels.planned((kernels.FWD, self.M, self.N, *key), input)
            self.bwd_key, self.db_key = (kernels.BWD, self.M, self.N, *key), (kernels.BWD_DB, self.M, self.N, *key)
            self.planned, self.bwd, self.db = kernels.planned, (None, None), (None, None)
        else:
            self.kp = kernels.plan(self.M, self.N)

    def forward(self, input: Tensor, bias: Tensor | None) -> Tensor:
        y = input.new_empty(*self.dims)
        if self.glu:
            _LAST[self.fwd_op] = self.kp.cfg  # as a hit of the general launcher records it
        self.kp.forward(input, self.sx0, self.sx1, bias.contiguous() if bias is not None else None, y)
        return y

    # The backwards read the gradient as the general path's ``rows`` makes it: a 2-D one as it is, a contiguous
    # one as its own rows (no view), else its 2-D reshape (spelled out in each: a helper's frame and tuple cost
    # ~0.4 µs inside autograd's engine).
    def backward(self, g: Tensor, input: Tensor, bias: Tensor | None) -> Tensor:
        if self.two_d:
            sd0, sd1 = g.stride()
        elif g.is_contiguous():
            sd0, sd1 = self.nout, 1
        else:
            g = g.reshape(-1, self.nout)
            sd0, sd1 = g.stride()
        dx = input.new_empty(*self.in_dims)
        kp = self.kp
        if self.glu:  # the general launcher's plan: kept while the kernels' plans stand (_EPOCH)
            epoch, kp = self.bwd
            if epoch is not _EPOCH.get(0) or epoch is None:
                epoch, kp = self.bwd = (_epoch(), self.planned(self.bwd_key, input))
            else:
                _LAST[self.bwd_key[0]] = kp.cfg  # as a hit of the general launcher records it
        kp.backward(g, sd0, sd1, input, self.sx0, self.sx1, bias.contiguous() if bias is not None else None, dx)
        return dx

    def backward_db(self, g: Tensor, input: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
        if self.two_d:
            sd0, sd1 = g.stride()
        elif g.is_contiguous():
            sd0, sd1 = self.nout, 1
        else:
            g = g.reshape(-1, self.nout)
            sd0, sd1 = g.stride()
        dx = input.new_empty(*self.in_dims)
        db = bias.new_empty(self.nb)
        kp = self.kp
        if self.glu:
            epoch, kp = self.db
            if epoch is not _EPOCH.get(0) or epoch is None:
                epoch, kp = self.db = (_epoch(), self.planned(self.db_key, input))
            else:
                _LAST[self.db_key[0]] = kp.cfg
        kp.backward_db(g, sd0, sd1, input, self.sx0, self.sx1, bias.contiguous(), dx, db)
        return dx, db


class _DirectAct(torch.autograd.Function):
    """``apply(input, bias, plan)``: the plan's forward, saving ``input`` and ``bias``; its backward, or the
    registered backward ops wherever they are needed (``general``: the autograd formula of
    ``register_bias_act_ops``, and the dispatch functions for a saved input with other strides)."""

    @staticmethod
    def forward(ctx, input, bias, plan):
        ctx.save_for_backward(input, bias)
        ctx.plan = plan
        return plan.forward(input, bias)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        # The backward ops wherever the registered op is needed: a graph for a second derivative (their error),
        # a dispatch mode, a torch.func transform, a tensor subclass, compiled autograd (exporting is compiling).
        if (_grad_enabled() or type(grad) not in _PLAIN or _is_compiling() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing()):
            return (*plan.general[1](ctx, grad), None)
        input, bias = ctx.saved_tensors
        sx = plan.sx
        if not (input.is_contiguous() if sx is True else input.stride() == sx):
            # (a saved-tensor hook's copy in another layout: the general launchers read its strides)
            _, backward, backward_with_bias_grad = plan.general[2]
            if bias is not None and ctx.needs_input_grad[1]:
                return (*backward_with_bias_grad(grad, input, bias), None)
            return backward(grad, input, bias), None, None
        if bias is not None and ctx.needs_input_grad[1]:
            return (*plan.backward_db(grad, input, bias), None)
        return plan.backward(grad, input, bias), None, None


_direct = super(torch.autograd.Function, _DirectAct).apply  # the C++ apply, as apex.ops._dispatch's


class Lean:
    """The plans of one op (``glu``: SwiGLU, else GELU) and its eager entry: :meth:`run` answers the
    output, or None where the general path must take the call (having changed nothing). ``kernels``: the
    kernel module's getter; ``autograd_backward``: the registered ops' autograd formula; ``dispatch``: the
    op's ``(forward, backward, backward_with_bias_grad)`` on checked arguments; ``check``: its argument
    checks."""

    def __init__(self, glu: bool, kernels: Callable, autograd_backward: Callable, dispatch: tuple,
                 check: Callable):
        self.glu, self.check = glu, check
        self.general = (kernels, autograd_backward, dispatch)
        self.table = PlanTable()

    def run(self, input: object, bias: object) -> Tensor | None:
        # First, before any lookup: what torch.compile, torch.export (which compiles: see apex.ops._norm.prepare),
        # a dispatch mode, a torch.func transform or a tracer sees is the general path (nothing planned under them).
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(input) not in _PLAIN or type(bias) not in _PLAIN_OR_NONE):
            return None  # (a subclass, or not a tensor: the general path, its checks and errors)
        if not _triton_takes(input.is_cuda, input):
            return None
        ts = (input,) if bias is None else (input, bias)
        plan = self.table.last.get(0)
        # The last call's plan where this call has its options and its tensors pass the plan's guard (see
        # apex.ops._lean.refresh_guard), else the plan of the call's key.
        if plan is None or not ((bias is None) is (len(plan.key) == 4)
                                and _guarded(plan, ts)):
            # A contiguous input's strides are implied by its shape: is_contiguous() costs less than stride().
            if bias is None:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, input.device)
            else:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, input.device, bias.shape,
                       bias.dtype, bias.device)
            plan = self.table.get(key)
            if plan is None:
                plan = self.table.keep(key, self._plan(key, input, bias))
            if not plan:
                return None
            _refresh_guard(plan, ts)
        if _grad_enabled() and _any_requires_grad(input, bias):
            return _direct(input, bias, plan)
        return plan.forward(input, bias)

    def _plan(self, key: tuple, input: Tensor, bias: Tensor | None) -> ActPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the
        Triton path's launchers would not run the call as a plan does (fp64, empty, rows that are a copy)."""
        self.check(input, bias, self.glu)
        plan: ActPlan | bool = False
        n = input.shape[-1]
        if input.dtype is not _F64 and input.numel() and (n // 2 if self.glu else n):
            try:
                rows = input if input.dim() == 2 or key[1] is True else input.view(-1, n)
            except RuntimeError:  # strides no 2-D view reads: rows() copies them
                rows = None
            if rows is not None:
                plan = ActPlan(key, self.glu, input, rows, self.general)
        return plan
