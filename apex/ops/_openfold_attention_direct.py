"""The lean eager path of OpenFold's attention (``apex.ops.openfold_attention.attention``: ``AttnTri``,
``AttnBiasJIT``, ``AttnNoBiasJIT``) on the Triton path: a plan per argument layout and one plain
``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether
``check_args`` passes (it reads the shapes, dtypes and devices of ``q``, ``k``, ``v``, ``mask`` and ``bias``),
whether the kernels take it (not fp64), the operands the kernels read (``_operands``: the tensors as given where
their leading dims merge into one stride, else copies) and their 20 strides, the kernels' launch plan
(``apex._kernels.openfold_attention._plan``, by dims, dtype and device). :class:`Lean` keeps an :class:`AttnPlan`
per key of every one of those facts (each tensor's shape, strides (True where contiguous), dtype and device): a
hit stands for the checks and launches through the kernels' own launch functions (``launch_forward``,
``launch_backward``, which the general launchers call too, with the same arguments: the same bits). A miss is
checked first (the general path's errors, in its order) and planned only where the kernels run the call as a plan
does: fp16/bf16/fp32, nothing empty, operands that are the tensors given (a bool mask is converted, unmergeable
leading dims are copied: the general path's). A key that is not planned is kept as False. ``inf`` is no fact of
a plan (passed on), but must be a positive float (the general path checks and converts anything else).

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers (the general path, as before), the backend and whether a gradient is
needed. The mask is no input of the Function (it gets no gradient; the general path records no graph for a mask
alone requiring one). The backward takes the general backward (``_triton_backward``) wherever the plan's launches
would not be what it launches: a graph for a second derivative, a subclass gradient, compiling, a dispatch mode,
a ``torch.func`` transform, a tracer; and where a saved-tensor hook gave ``q``, ``k``, ``v``, the mask or the bias
back with other strides (then with the operands of the tensors it gave back).

Visible difference: the output's ``grad_fn`` is ``_DirectOpenFoldAttentionBackward`` (the general path's:
``_AttentionTritonBackward``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex.ops._checks import member_set
from apex.ops._lean import EPOCH as _EPOCH
from apex.ops._lean import PlanTable
from apex.ops._lean import epoch as _epoch
from apex.ops._lean import triton_takes as _triton_takes

Tensor = torch.Tensor
_PLAIN = member_set(torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = member_set(torch.Tensor, torch.nn.Parameter, type(None))
_KERNEL_DTYPES = member_set(torch.float32, torch.float16, torch.bfloat16)
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_F32 = torch.float32


def _facts(t: Tensor, on_gpu: bool) -> tuple:
    """A mask's or bias's facts (shape, strides or True, dtype, device as :meth:`Lean.run`'s key holds it)."""
    return (t.shape, t.is_contiguous() or t.stride(), t.dtype,
            (t.get_device() if t.is_cuda else t.device) if on_gpu else -1 if t.is_cpu else t.device)


class AttnPlan:
    """One argument layout's launches. ``sq``, ``sk``, ``sv``, ``sm``, ``sb``: the strides of ``q``, ``k``, ``v``,
    the mask and the bias as the key holds them (True where contiguous; None where absent), which the backward
    compares its saved tensors' with; ``dims``, ``strides``, ``scale``: the kernels' geometry (``_operands``' of
    the first call: a contiguous tensor's strides along size-1 dims, which address nothing, are that call's);
    ``kp``: the kernels' launch plan with the :data:`_EPOCH` it was looked up in (looked up again after an
    override or an assumed device, as the general launcher would); ``full``, ``bias_shape``: the general
    backward's."""

    __slots__ = ("key", "on_gpu", "sq", "sk", "sv", "sm", "sb", "dims", "strides", "scale", "full", "bias_shape",
                 "f32", "qsize", "ksize", "kp", "lean", "launch_forward", "launch_backward")

    def __init__(self, key: tuple, q: Tensor, mask, bias, full: tuple, dims: tuple, strides: tuple, lean):
        self.key, self.on_gpu, self.lean = key, q.is_cuda, lean
        self.sq, self.sk, self.sv = key[1], key[5], key[9]
        self.sm = mask.is_contiguous() or mask.stride() if mask is not None else None
        self.sb = bias.is_contiguous() or bias.stride() if bias is not None else None
        self.full, self.dims, self.strides = full, dims, strides
        self.bias_shape = bias.shape if bias is not None else None
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        self.f32 = q.dtype is _F32  # (the statistics are new_empty of q, without a dtype)
        # The outputs' and gradients' sizes: new_empty of these is empty_like(t, memory_format=contiguous_format)
        self.qsize, self.ksize = tuple(q.shape), tuple(key[4])
        kernels = lean.kernels()
        self.launch_forward, self.launch_backward = kernels.launch_forward, kernels.launch_backward
        self.launch_plan(q)

    def launch_plan(self, q: Tensor) -> tuple:
        """The kernels' plan, now (kept with the current epoch)."""
        kp = self.lean.kernels()._plan(self.dims, q)
        self.kp = (_epoch(), kp)
        return kp

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask, bias, inf: float) -> Tensor:
        """``_triton_forward``'s allocations and launch (the kernel module's ``forward``'s): the output. (The
        forward's launch plan is the one looked up with this plan: an invalidation empties the table of plans.)"""
        z, h, nq, _, _ = dims = self.dims
        o = q.new_empty(*self.qsize)
        lse = q.new_empty(z, h, nq) if self.f32 else q.new_empty(z, h, nq, dtype=_F32)
        self.launch_forward(self.kp[1], q, k, v, mask, bias, o, lse, self.scale, inf, dims, self.strides)
        return o


class _DirectOpenFoldAttention(torch.autograd.Function):
    """``apply(q, k, v, bias, (plan, mask, inf))``: the plan's forward, saving what the general Function saves;
    its backward, or the general backward wherever that is needed."""

    @staticmethod
    def forward(ctx, q, k, v, bias, args):
        plan, mask, inf = args
        # (AttnPlan.forward, inline: a frame less)
        z, h, nq, _, _ = dims = plan.dims
        o = q.new_empty(*plan.qsize)  # (empty_like(q, memory_format=torch.contiguous_format): the same, for less)
        lse = q.new_empty(z, h, nq) if plan.f32 else q.new_empty(z, h, nq, dtype=_F32)
        plan.launch_forward(plan.kp[1], q, k, v, mask, bias, o, lse, plan.scale, inf, dims, plan.strides)
        if plan.sm is None and plan.sb is None:
            ctx.save_for_backward(q, k, v, o, lse)
        else:
            ctx.save_for_backward(q, k, v, o, lse, mask, bias)
        ctx.args = args
        return o

    @staticmethod
    def backward(ctx, do):
        plan, _, inf = ctx.args
        if plan.sm is None and plan.sb is None:
            q, k, v, o, lse = ctx.saved_tensors
            mask = bias = None
        else:
            q, k, v, o, lse, mask, bias = ctx.saved_tensors
        need_ds = bias is not None and ctx.needs_input_grad[3]
        # The general backward wherever it is needed: a graph for a second derivative (its behaviour), a subclass
        # gradient, compiled autograd, a dispatch mode, a torch.func transform, a tracer; and saved operands a
        # saved-tensor hook gave back in another layout (then with their own operands: the plan's strides would
        # not be theirs).
        sq, sk, sv = plan.sq, plan.sk, plan.sv
        if (_grad_enabled() or type(do) not in _PLAIN or _is_compiling() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing()
                or not (q.is_contiguous() if sq is True else q.stride() == sq)
                or not (k.is_contiguous() if sk is True else k.stride() == sk)
                or not (v.is_contiguous() if sv is True else v.stride() == sv)
                or mask is not None and not (mask.is_contiguous() if plan.sm is True else mask.stride() == plan.sm)
                or bias is not None and not (bias.is_contiguous() if plan.sb is True else bias.stride() == plan.sb)):
            lean = plan.lean
            q_, k_, v_, m_, b_, dims, strides = lean.operands(q, k, v, mask, bias, plan.full)
            dq, dk, dv, _, dbias, _, _ = lean.general(do, q_, k_, v_, o.contiguous(), lse.contiguous(), m_, b_,
                                                      need_ds, q.shape, k.shape, plan.full, plan.bias_shape, dims,
                                                      strides, plan.scale, inf)
            return dq, dk, dv, dbias, None
        # The general backward's allocations and launches (the kernel module's backward's).
        epoch, kp = plan.kp
        if epoch is not _EPOCH.get(0) or epoch is None:
            kp = plan.launch_plan(q)
        z, h, nq, nk, _ = dims = plan.dims
        dq, dk, dv = q.new_empty(*plan.qsize), k.new_empty(*plan.ksize), v.new_empty(*plan.ksize)
        if plan.f32:
            ds = q.new_empty(z, h, nq, nk) if need_ds else None
            delta = q.new_empty(z, h, nq)
        else:
            ds = q.new_empty(z, h, nq, nk, dtype=_F32) if need_ds else None
            delta = q.new_empty(z, h, nq, dtype=_F32)
        # (the kernels read do as contiguous rows of D, as they wrote o)
        plan.launch_backward(kp, do.contiguous(), q, k, v, mask, bias, o, lse, plan.scale, inf, need_ds, dims,
                             plan.strides, dq, dk, dv, ds, delta)
        return dq, dk, dv, ds.view(plan.full).sum_to_size(plan.bias_shape).to(bias.dtype) if need_ds else None, None


_direct = super(torch.autograd.Function, _DirectOpenFoldAttention).apply  # the C++ apply (no Python wrapper)


class Lean:
    """The plans of OpenFold's attention and its eager entry: :meth:`run` answers the output, or None where the
    general path must take the call (having changed nothing). ``check``: ``check_args``; ``operands``:
    ``_operands``; ``general``: ``_triton_backward``; ``kernels``: the kernel module's getter (imported at the
    first plan: importing apex imports no Triton)."""

    def __init__(self, check: Callable, operands: Callable, general: Callable, kernels: Callable):
        self.check, self.operands, self.general, self.kernels = check, operands, general, kernels
        self.table = PlanTable()

    def run(self, q: object, k: object, v: object, mask: object, bias: object, inf: object) -> Tensor | None:
        # First: what torch.compile, torch.export, a dispatch mode, a torch.func transform or a tracer sees is the
        # general path (nothing planned under them), as are subclasses, non-tensors and an inf to check or convert.
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN
                or type(mask) not in _PLAIN_OR_NONE or type(bias) not in _PLAIN_OR_NONE
                or type(inf) is not float or not inf > 0):
            return None
        # The backend before the key: another backend's call (the CPU's default) pays for no key, and plans are
        # only made where the Triton kernels run (the general path raises a backend's error, after its checks).
        on_gpu = q.is_cuda
        if not _triton_takes(on_gpu, q):
            return None
        # Every fact the checks and launches read (a contiguous tensor's strides are implied by its shape). A device
        # as the key holds it, without a torch.device built: by q's kind (the two kinds never mix in one key), a
        # CUDA tensor's index (another's device) where q is a CUDA tensor, else -1 for a CPU tensor (another's
        # device).
        if on_gpu:
            key = (q.shape, q.is_contiguous() or q.stride(), q.dtype, q.get_device(),
                   k.shape, k.is_contiguous() or k.stride(), k.dtype, k.get_device() if k.is_cuda else k.device,
                   v.shape, v.is_contiguous() or v.stride(), v.dtype, v.get_device() if v.is_cuda else v.device)
        else:
            key = (q.shape, q.is_contiguous() or q.stride(), q.dtype, -1 if q.is_cpu else q.device,
                   k.shape, k.is_contiguous() or k.stride(), k.dtype, -1 if k.is_cpu else k.device,
                   v.shape, v.is_contiguous() or v.stride(), v.dtype, -1 if v.is_cpu else v.device)
        if mask is not None or bias is not None:  # (None holds an absent one's place)
            key += (None if mask is None else _facts(mask, on_gpu), None if bias is None else _facts(bias, on_gpu))
        table = self.table
        plan = table.last.get(0)  # the last call's plan first: one comparison of the key
        if plan is None or plan.key != key:
            plan = table.plans.get(key)
            if plan is None:
                plan = table.keep(key, self._plan(key, q, k, v, mask, bias))
            if not plan:
                return None
            table.last[0] = plan
        # Grad mode alone decides: the Function's output needs no gradient where none of its inputs does.
        if _grad_enabled():
            return _direct(q, k, v, bias, (plan, mask, inf))
        return plan.forward(q, k, v, mask, bias, inf)

    def _plan(self, key: tuple, q: Tensor, k: Tensor, v: Tensor, mask, bias) -> AttnPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the kernels would not
        run the call as a plan does (fp64, empty, operands the general path converts or copies)."""
        full = self.check(q, k, v, mask, bias)
        if q.dtype not in _KERNEL_DTYPES or 0 in full or not q.shape[-1] or \
                mask is not None and mask.dtype is torch.bool:
            return False
        q_, k_, v_, m_, b_, dims, strides = self.operands(q, k, v, mask, bias, full)
        if q_ is not q or k_ is not k or v_ is not v or m_ is not mask or b_ is not bias:
            return False  # (copies: the general path's)
        return AttnPlan(key, q, mask, bias, full, dims, strides, self)
