"""The lean eager path of ``layer_norm`` and ``rms_norm`` on the Triton path: a plan per argument layout and one
plain ``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether the checks
pass (``apex.ops._norm.check_args`` and ``route`` read the input's shape, dtype and device, ``normalized_shape``,
each parameter's shape, dtype and device, the output dtype), the kernels' ``m × n`` rows, the input's row stride
(its 2-D row view's, ``rows_view``), the outputs' layout and the kernels' launch plans. :class:`NormLean` keeps a
:class:`NormPlan` per key of every one of those facts: a hit stands for the checks and launches through the
kernels' own plan methods (``apex._kernels._norm._Plan.forward``/``backward``, which the general launchers call
too, with the same arguments: the same bits). A miss is checked first (the general path's errors, in its order)
and planned only where the Triton kernels run the call: the kernels' dtypes, a row that fits them, not empty, and
rows that are a view of the input (else ``rows_view`` copies it). A key that is not planned is kept as False.

The parameters' facts are read at every call: ``param.data = ...`` changes a parameter's dtype, device or shape
without changing the parameter. ``eps`` and ``memory_efficient`` are no facts of a plan (they are passed on).

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers (they take the general path, as before), the backend (an ``apex.backend``
block or ``APEX_BACKEND`` may change it between calls) and whether a gradient is needed. Autocast is not read
here, as the general path's ``layer_norm``/``rms_norm`` do not read it (the modules and functional forms cast
before calling them). The backward takes the registered backward op wherever it is needed (a graph for a second
derivative, a dispatch mode, a subclass gradient), and wherever a saved-tensor hook gave a saved tensor back with
other strides.
"""

from __future__ import annotations

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex._kernels import _tuning
from apex.ops._lean import EPOCH as _EPOCH
from apex.ops._lean import PlanTable
from apex.ops._lean import epoch as _epoch
from apex.ops._lean import exact_shape as _exact_shape
from apex.ops._lean import refresh_guard as _refresh_guard
from apex.ops._lean import triton_takes as _triton_takes
from apex.ops._norm import _KERNEL_DTYPE_SET, _PLAIN, _PLAIN_OR_NONE, MAX_FUSED_N, check_args, grad_rows, rows_view

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_DTYPE = torch.dtype
_F32 = torch.float32
_CONTIG = torch.contiguous_format
_LAST = _tuning.last


def _kernels():
    import apex._kernels._norm as kernels  # (at the first plan: no Triton import when apex is)

    return kernels


class NormPlan:
    """One argument layout's launches. ``sx``: the input's strides, or True for a contiguous input (the
    backward compares its saved input's with them); ``sx0``: its rows' stride (``n`` where contiguous: a
    contiguous tensor may hold any stride along a size-1 dim); ``fwd``: the kernels' forward plan; ``bwd``: per
    ``memory_efficient``, the backward's, with the :data:`_EPOCH` it was looked up in (looked up again after an
    override or an assumed device, as the general launcher would); ``same_out``: the output is ``empty_like``
    of the input (its dtype, contiguous), ``f32``: the input is fp32 (the statistics are ``new_empty`` of it);
    ``shape``, ``in_dtype``: the checked ``normalized_shape`` and the input dtype (the registered backward's)."""

    __slots__ = ("key", "on_gpu", "is_rms", "m", "n", "sx", "sx0", "fwd", "bwd", "out_dtype", "in_dtype",
                 "same_out", "f32", "shape", "general", "guards", "guard_builds", "no_w", "no_b")

    def __init__(self, key: tuple, is_rms: bool, input: Tensor, shape: tuple, m: int, n: int, sx0: int,
                 out_dtype: _DTYPE, general):
        self.key, self.is_rms, self.general = key, is_rms, general
        self.on_gpu = input.is_cuda
        self.m, self.n, self.sx, self.sx0, self.shape = m, n, key[1], sx0, shape
        self.in_dtype, self.out_dtype = input.dtype, out_dtype
        self.same_out = out_dtype is input.dtype and key[1] is True
        self.f32 = input.dtype is _F32
        self.fwd = _kernels()._plan(input, m, n, is_rms, False)
        self.bwd = [(None, None), (None, None)]
        self.guards, self.guard_builds = [], 0
        self.no_w, self.no_b = len(key) < 9 or key[6] is None, len(key) in (6, 9)  # (the key's forms: see run)

    def forward(self, input: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float, ctx=None,
                me: bool = False) -> Tensor:
        """``forward_rows``' allocations and launch: the output; with ``ctx`` (:class:`_DirectNorm`'s), what
        the ``_Direct`` Functions of ``layer_norm``/``rms_norm`` save, saved (here: a frame and a tuple fewer)."""
        y = (torch.empty_like(input) if self.same_out
             else torch.empty_like(input, dtype=self.out_dtype, memory_format=_CONTIG))
        rstd = input.new_empty(self.m) if self.f32 else torch.empty(self.m, dtype=_F32, device=input.device)
        mean = rstd if self.is_rms else rstd.new_empty(self.m)
        kp = self.fwd
        _LAST[kp.op] = kp.cfg  # as a hit of the general launcher records it
        kp.forward(input, self.sx0, weight.contiguous() if weight is not None else None,
                   bias.contiguous() if bias is not None else None, eps, None, 0, None, y, mean, rstd)
        if ctx is not None:
            if me:
                ctx.save_for_backward(y, weight, bias, None, rstd)
            else:
                ctx.save_for_backward(input, weight, bias, None if self.is_rms else mean, rstd)
            ctx.args = (self, eps, me)
        return y

    def backward(self, dy: Tensor, v: Tensor, sv: int, weight: Tensor | None, bias: Tensor | None, mean, rstd,
                 eps: float, me: bool) -> tuple:
        """:class:`_DirectNorm`'s gradients: ``backward_rows``' allocations and launches on the saved ``v`` of row
        stride ``sv`` (``dx`` as ``out_like=dy`` makes it)."""
        if dy.is_contiguous():
            g, sg = dy, self.n
            dx = (torch.empty_like(dy) if self.out_dtype is self.in_dtype
                  else torch.empty_like(dy, dtype=self.in_dtype, memory_format=_CONTIG))
        else:
            g, sg = grad_rows(dy, self.n)
            dx = torch.empty_like(dy, dtype=self.in_dtype, memory_format=_CONTIG)
        epoch, kp = self.bwd[me]
        if epoch is not _EPOCH.get(0) or epoch is None:  # (_plan records the configuration)
            kp = _kernels()._plan(v, self.m, self.n, self.is_rms, True)
            self.bwd[me] = (_epoch(), kp)
        else:
            _LAST[kp.op] = kp.cfg
        dw, db = kp.backward(g, sg, v, sv, weight.contiguous() if weight is not None else None,
                             bias.contiguous() if bias is not None else None, mean, rstd, me, None, 0, eps, dx)
        return dx, dw, db, None, None, None


class _DirectNorm(torch.autograd.Function):
    """``apply(input, weight, bias, plan, eps, memory_efficient)``: the plan's forward, saving what the
    ``_Direct`` Functions of ``layer_norm``/``rms_norm`` save; its backward, or the registered backward op
    (``plan.general``) wherever that is needed."""

    @staticmethod
    def forward(ctx, input, weight, bias, plan, eps, me):
        return plan.forward(input, weight, bias, eps, ctx, me)

    @staticmethod
    def backward(ctx, dy):
        plan, eps, me = ctx.args
        v, weight, bias, mean, rstd = ctx.saved_tensors
        # The registered op wherever it is needed: a graph for a second derivative (its error), a subclass
        # gradient, compiled autograd (exporting is compiling), a dispatch mode, a torch.func transform, a tracer;
        # and a saved tensor a saved-tensor hook gave back in another layout (the general launchers read it).
        if (_grad_enabled() or type(dy) not in _PLAIN or _is_compiling() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing()
                or not (v.is_contiguous() if me or plan.sx is True else v.stride() == plan.sx)):
            dx, dw, db = plan.general(dy, v, weight, bias, mean, rstd, plan.shape, me, plan.in_dtype, eps)
            return dx, dw if weight is not None else None, db if bias is not None else None, None, None, None
        # (the plan's gradients are None where a parameter is)
        return plan.backward(dy, v, plan.n if me else plan.sx0, weight, bias, mean, rstd, eps, me)


_direct = super(torch.autograd.Function, _DirectNorm).apply  # the C++ apply, as apex.ops._dispatch's


class NormLean:
    """The plans of one op (``is_rms``: RMSNorm, else LayerNorm) and its eager entry: :meth:`run` answers the
    output, or None where the general path must take the call (having changed nothing). ``general``: the
    registered backward as ``(dy, v, weight, bias, mean, rstd, shape, memory_efficient, dx_dtype, eps) ->
    (dx, dw, db)``."""

    def __init__(self, is_rms: bool, general):
        self.is_rms, self.general = is_rms, general
        self.table = PlanTable()

    def run(self, input: object, normalized_shape: object, weight: object, bias: object, eps: object,
            memory_efficient: object, out_dtype: object) -> Tensor | None:
        # First, before any lookup: what torch.compile, torch.export (which compiles), a dispatch mode, a
        # torch.func transform or a tracer sees is the general path (nothing planned under them).
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(input) not in _PLAIN or type(weight) not in _PLAIN_OR_NONE
                or type(bias) not in _PLAIN_OR_NONE):
            return None  # (a subclass, or not a tensor: the general path, its checks and errors)
        # The backend before the key: another backend's call (the CPU's default) pays for no key, and plans are
        # only made where the Triton kernels run (the general path raises a backend's error, in its order).
        on_gpu = input.is_cuda
        if not _triton_takes(on_gpu, input):
            return None
        # The tensors in one order per plan (which of the parameters are None is in the key).
        if weight is None:
            ts = (input,) if bias is None else (input, bias)
        else:
            ts = (input, weight) if bias is None else (input, weight, bias)
        table = self.table
        plan = table.last.get(0)
        # The last call's plan where this call has its key's facts: the options compared (``normalized_shape`` by
        # identity, else as the key compares it), the tensors' in one C call (one of plan.guards: see refresh_guard).
        if (plan is not None and plan.guards and out_dtype is plan.key[5]
                and (weight is None) is plan.no_w and (bias is None) is plan.no_b
                and (normalized_shape is plan.key[4] or _exact_shape(normalized_shape) == plan.key[4])
                and (plan.guards[0].check(*ts) or len(plan.guards) > 1 and plan.guards[1].check(*ts))):
            if _grad_enabled():
                return _direct(input, weight, bias, plan, float(eps), bool(memory_efficient))
            return plan.forward(input, weight, bias, float(eps))
        normalized_shape = _exact_shape(normalized_shape)
        if normalized_shape is None:
            return None
        if out_dtype is not None and type(out_dtype) is not _DTYPE:
            return None
        # Every fact the checks read; a contiguous input's strides are implied by its shape (is_contiguous()
        # costs less than stride()). A parameter's facts are read each call (``param.data = ...``). A device as its
        # index where it is a CUDA or CPU tensor's (-1 on the CPU: the two never equal; get_device(), is_cuda and
        # is_cpu make no object, where ``.device`` builds a torch.device, ~3% of a training step's host time
        # here), else the device itself.
        dev = input.get_device() if on_gpu or input.is_cpu else input.device
        if weight is None:
            if bias is None:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, dev, normalized_shape,
                       out_dtype)
            else:
                key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, dev, normalized_shape,
                       out_dtype, None, bias.shape, bias.dtype,
                       bias.get_device() if bias.is_cuda or bias.is_cpu else bias.device)
        elif bias is None:
            key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, dev, normalized_shape,
                   out_dtype, weight.shape, weight.dtype,
                   weight.get_device() if weight.is_cuda or weight.is_cpu else weight.device)
        else:
            key = (input.shape, input.is_contiguous() or input.stride(), input.dtype, dev, normalized_shape,
                   out_dtype, weight.shape, weight.dtype,
                   weight.get_device() if weight.is_cuda or weight.is_cpu else weight.device, bias.shape,
                   bias.dtype, bias.get_device() if bias.is_cuda or bias.is_cpu else bias.device)
        if plan is None or plan.key != key:  # (the last call's plan first: one comparison of the key)
            plan = table.plans.get(key)
            if plan is None:
                plan = table.keep(key, self._plan(key, input, normalized_shape, weight, bias, out_dtype))
            if not plan:
                return None
            table.last[0] = plan
        _refresh_guard(plan, ts)
        # Grad mode alone decides (no _any_requires_grad call): the Function's output needs no gradient where
        # none of its inputs does, as the plain forward's (only the Function's ctx, dropped, is the difference).
        if _grad_enabled():
            return _direct(input, weight, bias, plan, float(eps), bool(memory_efficient))
        return plan.forward(input, weight, bias, float(eps))

    def _plan(self, key: tuple, input: Tensor, normalized_shape, weight, bias, out_dtype) -> NormPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the Triton
        kernels would not run the call as a plan does (other dtypes, rows too wide, empty, rows that are a
        copy)."""
        shape, m, n = check_args(input, normalized_shape, weight, bias)
        out_dtype = out_dtype or input.dtype
        if (n > MAX_FUSED_N or not m or not n or input.dtype not in _KERNEL_DTYPE_SET
                or out_dtype not in _KERNEL_DTYPE_SET
                or weight is not None and weight.dtype not in _KERNEL_DTYPE_SET
                or bias is not None and bias.dtype not in _KERNEL_DTYPE_SET):
            return False
        if key[1] is True:
            sx0 = n
        else:
            rows = rows_view(input, n)  # a view of the input, or a copy (not planned: the general path copies)
            if not (rows is input or rows._is_view() and rows.data_ptr() == input.data_ptr()):
                return False
            sx0 = rows.stride(0)
        return NormPlan(key, self.is_rms, input, shape, m, n, sx0, out_dtype, self.general)
