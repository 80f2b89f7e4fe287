"""The lean eager path of ``SoftmaxCrossEntropyLoss.apply`` on the Triton path: a plan per argument layout and
one plain ``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether
``_check`` passes (it reads the logits' rank, shape, dtype and device, the labels' shape, dtype and device,
``smoothing`` and ``padding_idx``), the logits' row stride, whether the labels need a contiguous copy, the
kernels' scalar arguments (``smoothing``, ``padding_idx`` as the kernels read it) and their launch plans
(:func:`apex._kernels.xentropy._plan`, by shape, dtype and device). :class:`Lean` keeps an :class:`XentPlan`
per key of every one of those facts (the logits' shape, strides (True where contiguous), dtype and device; the
labels' shape, contiguity, dtype and device; ``smoothing``; ``padding_idx``): a hit stands for the checks and
launches the kernels the general launchers (:func:`apex._kernels.xentropy.forward`, ``backward``) launch, with
the same arguments (the same bits). A miss is checked first (the general path's errors, in its order) and
planned only where the Triton path launches the call as the plan does: ``[rows, V]`` logits with unit column
stride (others are reshaped or copied), not fp64 (the PyTorch path's), not empty. A key that is not planned is
kept as False, so that the next call goes to the general path at once.

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers (the registered ops, as before), the backend, whether a gradient is
needed, and the arguments the key would confuse or that depend on the call: ``smoothing`` not a float and
``padding_idx`` neither an int nor None (``True == 1 == 1.0`` as keys), and ``inplace_backward`` other than
False (its check reads whether the logits are a leaf): the general path takes those. The backward takes the
general eager backward (``_eager_backward``) wherever the plan's launch would not be what it launches (a graph
for a second derivative, a dispatch mode, a subclass gradient, saved tensors a saved-tensor hook gave back
with other strides).
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
_FWD_OP, _BWD_OP = "xentropy.fwd", "xentropy.bwd"  # (apex._kernels.xentropy._plan's names)


class XentPlan:
    """One layout's launches. ``m, v``: the logits' sizes; ``sx``: their strides, or True where contiguous
    (the backward compares its saved logits' with them); ``lab_contig``: the labels are their own contiguous
    copy; ``f32``: fp32 logits (the losses' dtype: no dtype argument); ``fwd``: ``(launcher, arguments after
    the four tensors, warps, configuration)``, filled at the first call the Triton path takes (no kernels
    loaded for a layout only the PyTorch path sees); ``bwd``: :meth:`backward_launch`'s, with the
    :data:`_EPOCH` it was looked up in (an override or an assumed device between a forward and its backward
    counts, as in the general launcher); ``general``: the eager Function's backward (``_eager_backward``) and
    ``args`` the ``ctx.args`` it reads."""

    __slots__ = ("key", "on_gpu", "m", "v", "sx", "sx0", "lab_contig", "f32", "scalars", "fwd", "bwd", "kernels",
                 "general", "args", "guards", "guard_builds")

    def __init__(self, key: tuple, logits: Tensor, labels_contiguous: bool, smoothing: float,
                 padding_idx: int | None, pad: int, kernels: Callable, general: Callable):
        self.key, self.on_gpu, self.sx, self.lab_contig = key, logits.is_cuda, key[1], labels_contiguous
        self.guards, self.guard_builds = [], 0
        self.m, self.v = logits.shape
        # A contiguous logits' row stride is V (a contiguous tensor differs only along a size-1 dim, which
        # addresses row 0 alone there: the same values).
        self.sx0 = self.v if self.sx is True else self.sx[0]
        self.f32 = logits.dtype is _F32
        self.scalars = (float(smoothing), pad)
        self.args = (float(smoothing), padding_idx, False, None)  # _eager_forward's ctx.args (kernels: build)
        self.kernels, self.general = kernels, general
        self.fwd = self.bwd = None

    def build(self, logits: Tensor) -> None:
        """The forward's launch (the general launcher's ``forward(x, labels, smoothing, pad)``)."""
        kernels = self.kernels()
        self.args = (*self.args[:3], kernels)
        launch, rows, block, warps, stages, cfg, m, v = kernels._plan(logits, False)
        smoothing, pad = self.scalars
        self.fwd = (launch, (m, v, self.sx0, smoothing, pad, rows, block, stages, smoothing != 0.0), warps, cfg)

    def backward_launch(self, logits: Tensor) -> tuple:
        """``(epoch, launcher, arguments before and after the gradient's stride, warps, configuration)`` now
        (looked up again, as the general launcher does at each launch)."""
        launch, rows, block, warps, _, cfg, m, v = self.kernels()._plan(logits, True)
        self.bwd = (_epoch(), launch, (m, v, self.sx0, v), (*self.scalars, rows, block), warps, cfg)
        return self.bwd

    def forward(self, logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        if self.f32:
            losses, lse = logits.new_empty(self.m), logits.new_empty(self.m)
        else:
            losses, lse = logits.new_empty(self.m, dtype=_F32), logits.new_empty(self.m, dtype=_F32)
        launch, args, warps, cfg = self.fwd
        _LAST[_FWD_OP] = cfg  # as a hit of the general launcher records it
        launch(logits, labels if self.lab_contig else labels.contiguous(), losses, lse, *args, num_warps=warps)
        return losses, lse


def _backward(ctx, grad):
    plan = ctx.plan
    logits, lse, labels = ctx.saved_tensors
    # The general eager backward wherever the plan's launch is not what it would launch: a graph for a second
    # derivative, a dispatch mode, a torch.func transform, a subclass gradient, compiled autograd, saved
    # tensors in another layout (a saved-tensor hook's copy).
    if (_grad_enabled() or type(grad) not in _PLAIN or _is_compiling() or _dispatch_modes()
            or _are_functorch_transforms_active() or _is_tracing()
            or not (logits.is_contiguous() if plan.sx is True else logits.stride() == plan.sx)
            or not labels.is_contiguous()):
        ctx.args = plan.args
        return plan.general(ctx, grad)[:2]
    epoch, launch, head, tail, warps, cfg = plan.bwd or _NO_BWD
    if epoch is not _EPOCH.get(0) or epoch is None:
        epoch, launch, head, tail, warps, cfg = plan.backward_launch(logits)
    else:
        _LAST[_BWD_OP] = cfg  # as a hit of the general launcher records it
    out = logits.new_empty(plan.m, plan.v)
    launch(grad, logits, labels, lse, out, *head, grad.stride()[0], *tail, num_warps=warps)
    return out, None


_NO_BWD = (None,) * 6  # (no backward launch kept yet)


def _forward(ctx, logits, args):
    plan, labels = args
    # (plan.forward, inline: a frame less)
    if plan.f32:
        losses, lse = logits.new_empty(plan.m), logits.new_empty(plan.m)
    else:
        losses, lse = logits.new_empty(plan.m, dtype=_F32), logits.new_empty(plan.m, dtype=_F32)
    launch, fargs, warps, cfg = plan.fwd
    _LAST[_FWD_OP] = cfg
    launch(logits, labels if plan.lab_contig else labels.contiguous(), losses, lse, *fargs, num_warps=warps)
    ctx.save_for_backward(logits, lse, labels)
    ctx.plan = plan
    return losses


# Named as the public class (and the general eager Function), so that its graph nodes read
# SoftmaxCrossEntropyLossBackward as before.
_DirectLoss = type("SoftmaxCrossEntropyLoss", (torch.autograd.Function,), {
    "__module__": __name__, "__qualname__": "_DirectLoss",
    "forward": staticmethod(_forward), "backward": staticmethod(_backward)})
_direct = super(torch.autograd.Function, _DirectLoss).apply  # the C++ apply, as apex.ops._dispatch's


class Lean:
    """The plans of the loss and its eager entry: :meth:`run` answers the losses, or None where the general
    path must take the call (having changed nothing). ``kernels``: the kernel module's getter; ``check``:
    ``_check``; ``pad``: ``_pad``; ``general``: ``_eager_backward``."""

    def __init__(self, kernels: Callable, check: Callable, pad: Callable, general: Callable):
        self.kernels, self.check, self.pad, self.general = kernels, check, pad, general
        self.table = PlanTable()

    def run(self, logits: object, labels: object, smoothing: object = 0.0, padding_idx: object = 0,
            half_to_float: object = False, inplace_backward: object = False) -> Tensor | None:
        # First, before any lookup: what torch.compile, torch.export (which compiles), a dispatch mode, a
        # torch.func transform or a tracer sees is the general path (nothing planned under them).
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(logits) not in _PLAIN or type(labels) not in _PLAIN or type(smoothing) is not float
                or inplace_backward is not False or (padding_idx is not None and type(padding_idx) is not int)):
            return None  # (the general path: its checks, errors and registered ops)
        if not _triton_takes(logits.is_cuda, logits):
            return None
        ts = (logits, labels)
        plan = self.table.last.get(0)
        # The last call's plan where this call has its options and its tensors pass the plan's guard (see
        # apex.ops._lean.refresh_guard), else the plan of the call's key.
        if plan is None or not (smoothing == plan.key[8] and padding_idx == plan.key[9]
                                and _guarded(plan, ts)):
            # A contiguous tensor's strides are implied by its shape: is_contiguous() costs less than stride().
            key = (logits.shape, logits.is_contiguous() or logits.stride(), logits.dtype, logits.device,
                   labels.shape, labels.is_contiguous(), labels.dtype, labels.device, smoothing, padding_idx)
            plan = self.table.get(key)
            if plan is None:
                plan = self.table.keep(key, self._plan(key, logits, labels, smoothing, padding_idx))
            if not plan:
                return None
            _refresh_guard(plan, ts)
        if plan.fwd is None:
            plan.build(logits)
        if _grad_enabled() and logits.requires_grad:
            return _direct(logits, (plan, labels))
        return plan.forward(logits, labels)[0]

    def _plan(self, key: tuple, logits: Tensor, labels: Tensor, smoothing: float, padding_idx: int | None
              ) -> XentPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the Triton path
        would not launch the call as a plan does (not ``[rows, V]``, a column stride other than 1, fp64,
        empty)."""
        self.check(logits, labels, smoothing, padding_idx)
        if (logits.dim() != 2 or logits.dtype is _F64 or not logits.numel()
                or (key[1] is not True and logits.stride()[1] != 1)):
            return False
        return XentPlan(key, logits, key[5], smoothing, padding_idx, self.pad(padding_idx), self.kernels,
                        self.general)
