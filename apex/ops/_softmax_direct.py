"""The lean eager path of ``scaled_masked_softmax`` on the Triton path: a plan per scores-and-mask layout and
one plain ``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors and its scale follows from a few facts of its arguments:
whether ``check_args`` passes (the scores' dtype, rank and shape, ``causal``, the mask's dtype, device and
shape), the 4-D view the kernels read (its sizes and strides), the mask's broadcast strides and the launch
plans of :mod:`apex._kernels.scaled_masked_softmax`. :class:`Lean` keeps a :class:`SoftmaxPlan` per key of
every one of those facts (the scores' shape, strides, dtype and device, ``causal``, and the mask's shape,
strides, dtype and device, or None): a hit stands for the checks and launches what the general launchers
launch (:func:`~apex._kernels.scaled_masked_softmax.forward_launch`'s arguments, the same bits). A miss is
checked first (the general path's errors, in its order) and planned only where the kernels run the call: a
kernel dtype, not empty, a mask that broadcasts to the 4-D view (else the launcher's error, the general
path's to raise). A key that is not planned is kept as False.

Asked at every call, not planned: the scale, tensor subclasses, ``torch.compile``/``torch.export``, dispatch
modes, ``torch.func`` transforms and tracers (the registered op), the backend, and whether a gradient is
needed. The backward takes the registered backward op wherever it is needed (a second derivative, a dispatch
mode, a subclass gradient) and the general launcher for a saved output a saved-tensor hook gave back in
another layout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
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


class SoftmaxPlan:
    """One layout's launches. ``dims``: the scores' (the output's, the gradient's) sizes; ``launch``, ``tail``,
    ``warps``: the forward's (``launch(x, mask, y, scale, *tail, num_warps=warps)``); ``bwd_key``: the
    backward's kernel plan key, looked up in ``bplans`` (the kernels' cache) as the general launcher does, again
    whenever ``_tuning`` may have replaced it since (:data:`_EPOCH`): an override entered between a forward and
    its backward counts; ``sizes``: ``(n_rows, np, sq, sk)``; ``sy``: the 4-D strides of the contiguous output
    (and of a contiguous gradient) as the general backward reads them; ``bwd``: ``(epoch, kernel plan, launch
    tail for a contiguous gradient)`` of the last backward."""

    __slots__ = ("key", "on_gpu", "dims", "four_d", "dtype", "launch", "tail", "warps", "causal", "bwd_key",
                 "bplans", "sizes", "sy", "bwd", "kernels", "general", "guards", "guard_builds")

    def __init__(self, key: tuple, input: Tensor, mask: Tensor | None, causal: bool, kernels, general: Callable):
        four_d = input.dim() == 4
        # A contiguous tensor (key: True for its strides) is read at the strides contiguity implies, which may
        # differ from its own only along size-1 dims (where a stride addresses nothing): one plan for them all.
        if key[1] is True:
            input = _standard(input)
        if mask is not None and key[6] is True:
            mask = _standard(mask)
        x = input if four_d else input.unsqueeze(1)
        self.launch, self.tail, self.warps = kernels.forward_launch(x, mask, causal, None)
        self.key, self.on_gpu, self.dims, self.four_d = key, input.is_cuda, tuple(input.shape), four_d
        self.guards, self.guard_builds = [], 0
        self.causal, self.dtype = causal, input.dtype
        b, h, sq, sk = x.shape
        self.sizes = (b * h * sq, h, sq, sk)
        self.bwd_key = (b * h * sq, sk, None, input.dtype, causal, input.get_device())
        # A contiguous [b, np, sq, sk] output's strides, or those of the unsqueezed view of a 3-D one (unsqueeze
        # gives the new dim size·stride of the dim it precedes): what the general backward reads (no size is 0).
        self.sy = (h * sq * sk, sq * sk, sk, 1)
        self.bplans, self.bwd = kernels._BWD_PLANS, (None, None, None)
        self.kernels, self.general = kernels, general

    def forward(self, input: Tensor, mask: Tensor | None, scale: float) -> Tensor:
        y = input.new_empty(*self.dims)
        self.launch(input, mask if mask is not None else input, y, scale, *self.tail, num_warps=self.warps)
        return y

    def backward_launch(self, y: Tensor) -> tuple:
        """``(epoch, kernel plan, tail)`` of the backward on the saved output ``y`` now (a contiguous gradient's
        tail), looked up again."""
        kp = self.bplans.get(self.bwd_key)
        if kp is None:
            kp = self.kernels.backward_plan(self.bwd_key, y)
        self.bwd = (_epoch(), kp, self.kernels.backward_tail(kp, self.sizes, self.sy, self.sy, self.causal))
        return self.bwd


def _standard(t: Tensor) -> Tensor:
    """``t`` (contiguous) viewed at the strides of a contiguous tensor of its shape."""
    strides, step = [], 1
    for n in reversed(t.shape):
        strides.append(step)
        step *= max(n, 1)
    return t.detach().as_strided(t.shape, strides[::-1])


class _DirectSoftmax(torch.autograd.Function):
    """``apply(input, (plan, mask, scale))``: the plan's forward, saving the output; its backward, or the
    registered backward op wherever it is needed (``plan.general``: ``_bwd_op``). The mask (no gradient, not
    saved, not kept) travels in the tuple: an input tensor costs the C++ apply its bookkeeping."""

    @staticmethod
    def forward(ctx, input, args):
        plan, mask, scale = args
        y = input.new_empty(*plan.dims)  # (plan.forward, inline: a frame less)
        plan.launch(input, mask if mask is not None else input, y, scale, *plan.tail, num_warps=plan.warps)
        ctx.save_for_backward(y)
        ctx.args = (plan, scale)  # (one attribute)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        plan, scale = ctx.args
        # apex.ops._dispatch.eager's tests on dy, inlined (asked on every backward; exporting is compiling, see
        # apex.ops._norm.prepare); a saved output a saved-tensor hook gave back in another layout (the general
        # launcher reads its strides). (dy has y's dtype, a kernel dtype: autograd's engine casts a gradient to
        # its output's dtype, and a hook may not change it.)
        if (_grad_enabled() or type(dy) not in _PLAIN or _is_compiling() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing() or not y.is_contiguous()):
            return plan.general(dy, y, scale, plan.causal, plan.dtype), None
        # The plan's backward, inline (a frame less): its kept launch unless the kernels' plans were replaced.
        epoch, kp, tail = plan.bwd
        if epoch is not _EPOCH.get(0) or epoch is None:
            epoch, kp, tail = plan.backward_launch(y)
        dx = y.new_empty(*plan.dims)
        if not dy.is_contiguous():
            sd = (dy if plan.four_d else dy.unsqueeze(1)).stride()
            tail = plan.kernels.backward_tail(kp, plan.sizes, sd, plan.sy, plan.causal)
        kp[4](dy, y, dx, scale, *tail, num_warps=kp[3])
        return dx, None


_direct = super(torch.autograd.Function, _DirectSoftmax).apply  # the C++ apply, as apex.ops._dispatch's


class Lean:
    """The plans of the op and its eager entry: :meth:`run` answers the output, or None where the general path
    must take the call (having changed nothing). ``kernels``: the kernel module's getter; ``check``: the op's
    ``check_args``; ``check_scale``: its scale's; ``general_backward``: ``_bwd_op`` (the registered backward op,
    which takes the general dispatch)."""

    def __init__(self, kernels: Callable, check: Callable, check_scale: Callable, general_backward: Callable):
        self.kernels, self.check, self.check_scale = kernels, check, check_scale
        self.general_backward = general_backward
        self.table = PlanTable()

    def run(self, input: object, mask: object, scale: object, causal: object, checked: bool) -> Tensor | None:
        """``checked``: the caller has checked ``input`` and ``mask`` with ``causal`` (a hit needs no check
        either way; a miss checks unless the caller did)."""
        # First, before any lookup: what torch.compile, torch.export, a dispatch mode, a torch.func transform or
        # a tracer sees is the general path (nothing planned or cached under them).
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(input) not in _PLAIN):
            return None  # (torch.export compiles; a subclass, or not a tensor: the general path and its errors)
        if not _triton_takes(input.is_cuda, input):
            return None
        causal = True if causal else False
        if mask is None:
            ts = (input,)
        elif type(mask) in _PLAIN:
            ts = (input, mask)
        else:
            return None
        plan = self.table.last.get(0)
        # The last call's plan where this call has its options and its tensors pass the plan's guard (see
        # apex.ops._lean.refresh_guard), else the plan of the call's key.
        if plan is None or not (causal is plan.key[4] and (mask is None) is (len(plan.key) == 5)
                                and _guarded(plan, ts)):
            # A contiguous tensor's strides are implied by its shape (see SoftmaxPlan): is_contiguous() costs less
            # than stride().
            if mask is None:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, input.device, causal)
            else:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, input.device, causal,
                       mask.shape, mask.is_contiguous() or mask.stride(), mask.dtype, mask.device)
            plan = self.table.get(key)
            if plan is None:
                plan = self.table.keep(key, self._plan(key, input, mask, causal, checked))
            if not plan:
                return None
            _refresh_guard(plan, ts)
        scale = scale if type(scale) is float else self.check_scale(scale)
        if _grad_enabled() and input.requires_grad:
            return _direct(input, (plan, mask, scale))
        return plan.forward(input, mask, scale)

    def _plan(self, key: tuple, input: Tensor, mask: Tensor | None, causal: bool, checked: bool
              ) -> SoftmaxPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the kernels
        would not run the call as a plan does (not a kernel dtype, empty, a mask the 4-D view refuses)."""
        if not checked:
            self.check(input, mask, causal)
        plan: SoftmaxPlan | bool = False
        if input.dtype in _KERNEL_DTYPES and input.numel():
            try:
                plan = SoftmaxPlan(key, input, mask, causal, self.kernels(), self.general_backward)
            except RuntimeError:  # (_mask_strides': expand's error, raised by the general path's launch)
                plan = False
        return plan
