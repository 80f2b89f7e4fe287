"""The lean eager path of :class:`apex.parallel.SyncBatchNorm` on the Triton path: its dispatch and its
autograd Function, for ``apex.parallel._syncbn_direct`` (which reads the module's state and calls these).

Almost everything such a call derives besides its tensors follows from the input's shape: whether the
argument checks pass (at least 2 dimensions, the channel count, a kernel dtype, a non-empty batch), the
``(N, C, L)`` sizes, and from those the kernels' :class:`~apex._kernels.sync_batch_norm.Plan` (layouts,
grids, workspaces, each kernel bound to its grid). :func:`plan` looks these up once per ``(shape, dtype,
channel_last, num_features)``, every fact they derive from; the plan is the one the general path's
launchers use for the same sizes, and the launches are its methods: the same kernels with the same
arguments, the same results bit for bit. :func:`forward` launches them and records
:class:`SyncBatchnormDirect`: a tensor argument per differentiable input and one tuple for the rest, so that
the C++ ``apply`` and the engine handle five arguments instead of fifteen.

Each function here answers None where the general path must take the call, having changed
nothing, so that it raises its errors in its own order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from apex import _backend
from apex.ops.sync_batch_norm import _kernels

if TYPE_CHECKING:
    from apex._kernels.sync_batch_norm import Plan

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # fp64 takes PyTorch's path
_PLANS: dict = {}
_functorch_active = torch._C._are_functorch_transforms_active
_tracing_state = torch._C._get_tracing_state
_Parameter, _Tensor = torch.nn.Parameter, torch.Tensor


def plan(input: torch.Tensor, z: torch.Tensor | None, weight, bias, running_mean, running_var, tracked,
         channel_last: bool, num_features: int) -> Plan | None:
    """The kernels' plan of a call on ``input`` with these (None where absent), or None where the general path
    must take it: another backend (or the backend's error, the general path's to raise after its own checks),
    functorch transforms or tracing (they handle the general path's Function), an input a check refuses or the
    kernels do not take (fp64, empty), or tensors they cannot read next to ``input``."""
    try:
        backend = _backend._resolve(input.is_cuda, input)
    except RuntimeError:
        return None
    if backend != "triton" or _functorch_active() or _tracing_state() is not None:
        return None
    key = (input.shape, input.dtype, channel_last, num_features)
    p = _PLANS.get(key, False)
    if p is False:
        p = _plan(key)
    if p is None:
        return None
    # The kernels read these next to the input and contiguous: plain parameters and tensors, z of the input's
    # shape; anything else is the general path's (its error, or PyTorch's operators). Asked at every call, not
    # planned: a parameter can be moved between calls (Module.to replaces its data in place) or replaced.
    device = input.device
    if not ((weight is None or weight.__class__ is _Parameter and weight.device == device and weight.is_contiguous())
            and (bias is None or bias.__class__ is _Parameter and bias.device == device and bias.is_contiguous())
            and (running_mean is None or running_mean.__class__ is _Tensor and running_mean.device == device
                 and running_mean.is_contiguous() and running_var.__class__ is _Tensor
                 and running_var.device == device and running_var.is_contiguous())
            and (tracked is None or tracked.__class__ is _Tensor and tracked.device == device)
            and (z is None or z.__class__ is _Tensor and z.device == device and z.shape == input.shape)):
        return None
    return p


def _plan(key: tuple) -> Plan | None:
    """:func:`plan` of a key not cached yet, computed and cached (None too)."""
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


def forward(p: Plan, input: torch.Tensor, z: torch.Tensor | None, weight, bias, running_mean, running_var, tracked,
            eps: float, momentum: float, fuse_relu: bool, use_batch_stats: bool, group, gather) -> torch.Tensor:
    """The output of a call :func:`plan` accepted: batch statistics (the running ones updated with ``momentum >
    0``, ``tracked`` incremented in the kernel, or None) or the running statistics, then the normalisation,
    recorded by :class:`SyncBatchnormDirect` where autograd needs it. ``gather``: with ranks, the all-gather of
    :meth:`Plan.train_stats` (and the backward all-reduces over ``group``); None for the local batch."""
    # What the kernels read (and the backward keeps), made without recording a copy in the graph.
    x = input if input.is_contiguous() else input.detach().contiguous()
    zz = None
    if z is not None:
        zz = z if z.dtype == x.dtype and z.is_contiguous() else z.detach().contiguous().to(x.dtype)
    if not use_batch_stats:
        count, st = None, _kernels().eval_stats(p.C, weight, bias, running_mean, running_var, eps)
    else:
        count, st = p.train_stats(x, weight, bias, running_mean, running_var, eps, momentum, gather, tracked)
    y = p.normalize(x, zz, st, fuse_relu)
    if not (torch.is_grad_enabled() and (input.requires_grad or z is not None and z.requires_grad
                                         or weight is not None and weight.requires_grad
                                         or bias is not None and bias.requires_grad)):
        return y  # nothing to record: no Function, nothing saved
    return _direct_apply(input, z, weight, bias, (y, st, x, zz, p, count, fuse_relu, group, gather is not None))


class SyncBatchnormDirect(torch.autograd.Function):
    """``apply(input, z, weight, bias, (y, st, x, zz, plan, count, fuse_relu, group, distributed))``: the
    forward's kernels ran in :func:`forward` (they update the running statistics, which are no inputs of the
    graph), so this forward hands ``y`` to autograd and saves what the backward reads; ``x`` and ``zz`` are
    the contiguous input and residual the kernels read, ``count`` is None where the running statistics
    normalised. The backward is the general path's ``_fused_backward``, on the plan."""

    @staticmethod
    def forward(ctx, input, z, weight, bias, meta):
        ctx.save_for_backward(meta[2], meta[3], weight, bias, meta[1])
        ctx.meta = meta[4:]  # (not y, st, x, zz: the output kept by its own node would be a reference cycle)
        return meta[0]

    @staticmethod
    def backward(ctx, grad_output):
        x, zz, weight, bias, st = ctx.saved_tensors
        p, count, fuse_relu, group, distributed = ctx.meta
        need_x, need_z, need_w, need_b, _ = ctx.needs_input_grad
        dy = grad_output.contiguous()
        grad_weight = torch.empty_like(weight) if need_w else None
        grad_bias = torch.empty_like(bias) if need_b else None
        ws = p.backward_sums(dy, x, zz, st, fuse_relu, grad_weight, grad_bias)
        dx = dz = None
        if need_x or need_z:
            if count is not None and distributed:
                dist.all_reduce(ws[:2], group=group)
            dx, dz = p.backward_elemt(dy, x, zz, st, ws, count, fuse_relu, need_z)
        return dx if need_x else None, dz, grad_weight, grad_bias, None


# The C++ apply: no Python wrapper unwrapping functorch's dead wrappers (no transform is active here).
_direct_apply = super(torch.autograd.Function, SyncBatchnormDirect).apply
