"""The lean eager path of ``fused_add_rms_norm`` and ``fused_add_layer_norm`` on the Triton path: a plan per
argument layout and one plain ``autograd.Function``, as ``apex.ops._norm_direct``'s for the norms alone (see its
docstring: the same key, with the residual's shape, strides, dtype and device; the same cases left to the general
path). A hit launches through the kernels' own plan methods (``apex._kernels._norm._Plan``), with the arguments
the general ``_Direct`` Function of ``apex.ops.fused_add_norm`` passes them: the same bits.
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
from apex.ops._norm_direct import _kernels

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_F32 = torch.float32
_CONTIG = torch.contiguous_format
_LAST = _tuning.last


def _rows(t: Tensor, contiguous: bool, n: int) -> int:
    """The row stride of ``t``'s rows if they are a view of it (``rows_view``'s, no copy), else 0."""
    if contiguous:
        return n
    rows = rows_view(t, n)
    return rows.stride(0) if rows is t or rows._is_view() and rows.data_ptr() == t.data_ptr() else 0


class AddNormPlan:
    """One argument layout's launches (see ``_norm_direct.NormPlan``): ``sx0``, ``sr0``: the input's and the
    residual's row strides; ``h_dtype``: the sum's; ``same_out``: the output is ``empty_like`` of the input."""

    __slots__ = ("key", "on_gpu", "is_rms", "m", "n", "sx0", "sr0", "fwd", "bwd", "in_dtype", "res_dtype",
                 "h_dtype", "same_out", "f32", "shape", "general", "guards", "guard_builds")

    def __init__(self, key: tuple, is_rms: bool, input: Tensor, residual: Tensor, shape: tuple, m: int, n: int,
                 sx0: int, sr0: int, general):
        self.key, self.is_rms, self.general, self.shape = key, is_rms, general, shape
        self.on_gpu = input.is_cuda
        self.m, self.n, self.sx0, self.sr0 = m, n, sx0, sr0
        self.in_dtype, self.res_dtype = input.dtype, residual.dtype
        self.h_dtype = torch.promote_types(input.dtype, residual.dtype)
        self.same_out = key[1] is True
        self.f32 = input.dtype is _F32
        self.fwd = _kernels()._plan(input, m, n, is_rms, False)
        self.bwd = [(None, None), (None, None)]
        self.guards, self.guard_builds = [], 0

    def forward(self, input: Tensor, residual: Tensor, weight, bias, eps: float, ctx=None, me: bool = False):
        """``(y, h)``: ``forward_rows``' allocations and launch; with ``ctx``, what the general ``_Direct``
        saves, saved."""
        m = self.m
        y = (torch.empty_like(input) if self.same_out
             else torch.empty_like(input, dtype=self.in_dtype, memory_format=_CONTIG))
        rstd = input.new_empty(m) if self.f32 else torch.empty(m, dtype=_F32, device=input.device)
        mean = rstd if self.is_rms else rstd.new_empty(m)
        h = torch.empty_like(input, dtype=self.h_dtype, memory_format=_CONTIG)
        kp = self.fwd
        _LAST[kp.op] = kp.cfg  # as a hit of the general launcher records it
        kp.forward(input, self.sx0, weight.contiguous() if weight is not None else None,
                   bias.contiguous() if bias is not None else None, eps, residual, self.sr0, h, y, mean, rstd)
        if ctx is not None:
            ctx.set_materialize_grads(False)  # an output outside the loss: None (the general _Direct's)
            ctx.save_for_backward(y if me else h, weight, bias, None if self.is_rms else mean, rstd)
            ctx.args = (self, me)
        return y, h

    def backward(self, grad_y: Tensor, grad_h, v: Tensor, weight, bias, mean, rstd, me: bool) -> tuple:
        """The general ``_Direct`` backward's kernel branch: ``backward_rows`` on the contiguous saved ``v``."""
        n = self.n
        g, sg = (grad_y, n) if grad_y.is_contiguous() else grad_rows(grad_y, n)
        dr, sdr = grad_rows(grad_h, n) if grad_h is not None else (None, 0)
        h_dtype = self.h_dtype
        dx = (torch.empty_like(v) if v.dtype is h_dtype
              else torch.empty_like(v, dtype=h_dtype, memory_format=_CONTIG))
        epoch, kp = self.bwd[me]
        if epoch is not _EPOCH.get(0) or epoch is None:  # (_plan records the configuration)
            kp = _kernels()._plan(v, self.m, n, self.is_rms, True)
            self.bwd[me] = (_epoch(), kp)
        else:
            _LAST[kp.op] = kp.cfg
        dw, db = kp.backward(g, sg, v, n, weight.contiguous() if weight is not None else None,
                             bias.contiguous() if bias is not None else None, mean, rstd, me, dr, sdr, None, dx)
        return dx, dw, db


class _DirectAddNorm(torch.autograd.Function):
    """``apply(input, residual, weight, bias, plan, eps, memory_efficient)`` -> ``(y, h)``."""

    @staticmethod
    def forward(ctx, input, residual, weight, bias, plan, eps, me):
        return plan.forward(input, residual, weight, bias, eps, ctx, me)

    @staticmethod
    def backward(ctx, grad_y, grad_h):
        plan, me = ctx.args
        v, weight, bias, mean, rstd = ctx.saved_tensors
        in_dtype = plan.in_dtype
        if grad_y is None:
            grad_y = torch.zeros_like(v, dtype=in_dtype)
        # The registered op wherever it is needed (see _norm_direct._DirectNorm.backward), and a saved tensor a
        # saved-tensor hook gave back in another layout.
        if (_grad_enabled() or type(grad_y) not in _PLAIN or type(grad_h) not in _PLAIN_OR_NONE or _is_compiling()
                or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or not v.is_contiguous()):
            dh, dw, db = plan.general(grad_y, grad_h, v, weight, bias, mean, rstd, plan.shape, plan.is_rms, me,
                                      plan.h_dtype)
        else:
            dh, dw, db = plan.backward(grad_y, grad_h, v, weight, bias, mean, rstd, me)
        dt = dh.dtype
        return (dh if dt is in_dtype else dh.to(in_dtype), dh if dt is plan.res_dtype else dh.to(plan.res_dtype),
                dw if weight is not None else None, db if bias is not None else None, None, None, None)


_direct = super(torch.autograd.Function, _DirectAddNorm).apply  # the C++ apply, as apex.ops._dispatch's


class AddNormLean:
    """The plans of one fused-add op (``is_rms``) and its eager entry: :meth:`run` answers ``(y, h)``, or None
    where the general path must take the call. ``check_residual``: the general path's residual check (after
    ``check_args``, as there); ``general``: the registered backward as ``(grad_y, grad_h, v, weight, bias, mean,
    rstd, shape, is_rms, memory_efficient, h_dtype) -> (dh, dw, db)``."""

    def __init__(self, is_rms: bool, check_residual, general):
        self.is_rms, self.check_residual, self.general = is_rms, check_residual, general
        self.table = PlanTable()

    def run(self, input: object, residual: object, weight: object, bias: object, normalized_shape: object,
            eps: object, memory_efficient: object) -> tuple | None:
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(input) not in _PLAIN or type(residual) not in _PLAIN or type(weight) not in _PLAIN_OR_NONE
                or type(bias) not in _PLAIN_OR_NONE):
            return None
        on_gpu = input.is_cuda
        if not _triton_takes(on_gpu, input):
            return None
        # The tensors in one order per plan (which parameters are None is in the key).
        if weight is None:
            ts = (input, residual) if bias is None else (input, residual, bias)
        else:
            ts = (input, residual, weight) if bias is None else (input, residual, weight, bias)
        table = self.table
        plan = table.last.get(0)
        # The last call's plan where this call has its key's facts (see NormLean.run): one C call for the tensors'.
        if (plan is not None and plan.guards and (weight is None) is (plan.key[9] is None)
                and (bias is None) is (plan.key[10] is None)
                and (normalized_shape is plan.key[4] or _exact_shape(normalized_shape) == plan.key[4])
                and (plan.guards[0].check(*ts) or len(plan.guards) > 1 and plan.guards[1].check(*ts))):
            if _grad_enabled():
                return _direct(input, residual, weight, bias, plan, float(eps), bool(memory_efficient))
            return plan.forward(input, residual, weight, bias, float(eps))
        normalized_shape = _exact_shape(normalized_shape)
        if normalized_shape is None:
            return None
        # (devices as NormLean.run reads them: an index for CUDA and CPU tensors, else the device)
        key = (input.shape, input.is_contiguous() or input.stride(), input.dtype,
               input.get_device() if on_gpu or input.is_cpu else input.device, normalized_shape,
               residual.shape, residual.is_contiguous() or residual.stride(), residual.dtype,
               residual.get_device() if residual.is_cuda or residual.is_cpu else residual.device,
               None if weight is None else (weight.shape, weight.dtype, weight.get_device()
                                            if weight.is_cuda or weight.is_cpu else weight.device),
               None if bias is None else (bias.shape, bias.dtype,
                                          bias.get_device() if bias.is_cuda or bias.is_cpu else bias.device))
        if plan is None or plan.key != key:  # (the last call's plan first: one comparison of the key)
            plan = table.plans.get(key)
            if plan is None:
                plan = table.keep(key, self._plan(key, input, residual, normalized_shape, weight, bias))
            if not plan:
                return None
            table.last[0] = plan
        _refresh_guard(plan, ts)
        if _grad_enabled():  # (see NormLean.run)
            return _direct(input, residual, weight, bias, plan, float(eps), bool(memory_efficient))
        return plan.forward(input, residual, weight, bias, float(eps))

    def _plan(self, key: tuple, input: Tensor, residual: Tensor, normalized_shape, weight, bias):
        """The plan of a key not seen yet, checked as the general path checks (its errors, in its order); False
        where the kernels would not run the call as a plan does."""
        shape, m, n = check_args(input, normalized_shape, weight, bias)
        self.check_residual(input, residual)
        if (n > MAX_FUSED_N or not m or not n or input.dtype not in _KERNEL_DTYPE_SET
                or residual.dtype not in _KERNEL_DTYPE_SET
                or weight is not None and weight.dtype not in _KERNEL_DTYPE_SET
                or bias is not None and bias.dtype not in _KERNEL_DTYPE_SET):
            return False
        sx0, sr0 = _rows(input, key[1] is True, n), _rows(residual, key[6] is True, n)
        if not (sx0 and sr0):
            return False
        return AddNormPlan(key, self.is_rms, input, residual, shape, m, n, sx0, sr0, self.general)
