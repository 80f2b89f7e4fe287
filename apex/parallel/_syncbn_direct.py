"""The usual eager call of :class:`apex.parallel.SyncBatchNorm`, its host work cut to the module's state, a few
checks, the allocations and the launches.

:func:`module_forward` reads the module's state at each call (training, momentum, eps, fuse_relu, the
process group, parameters and buffers: any can change between calls) and hands the call to the Triton path's
lean dispatch, ``apex.ops._syncbn_direct`` (the kernels' plan of the input's shape, the launches and the
autograd Function); channel-first eval calls get the general path's ``F.batch_norm`` directly.

Anything else (PyTorch's path, fp64, an empty input, a tensor subclass, torch.compile, functorch
transforms, tracing, parameters the kernels cannot read) and every call that an error would answer takes
the general path of ``SyncBatchNorm.forward``, which raises the errors in its own order: the lean path
changes nothing before it hands a call over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from apex.ops import _syncbn_direct as direct

_MISSING = object()
_DIST = dist.is_available()


def _eval_batch_norm(mod, input: torch.Tensor) -> torch.Tensor | None:
    """The general path's ``F.batch_norm`` call in eval mode, reading the tables instead of ``__getattr__``
    (None where something else is in their place)."""
    params, buffers = mod._parameters, mod._buffers
    weight, bias = params.get("weight", _MISSING), params.get("bias", _MISSING)
    running_mean, running_var = buffers.get("running_mean", _MISSING), buffers.get("running_var", _MISSING)
    if weight is _MISSING or bias is _MISSING or running_mean is _MISSING or running_var is _MISSING:
        return None
    return F.batch_norm(input, running_mean, running_var, weight, bias, False, 0.0, mod.eps)


def module_forward(mod, input: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor | None:
    """``SyncBatchNorm.forward(input, z)`` (a plain tensor, not compiling: the caller's tests) where the Triton
    path or, in channel-first eval mode, PyTorch's batch norm takes it; None, having changed nothing, where
    the general path must take it, including every call it answers with an error."""
    training, track = mod.training, mod.track_running_stats
    use_batch_stats = training or not track
    if not (use_batch_stats or z is not None or mod.channel_last or mod.fuse_relu):
        # Eval: channel-first, PyTorch's batch norm, as on the general path (whose checks pass: at least 3
        # dimensions, C in dimension 1), before any plan (this call needs no Triton); 2-D, the kernels.
        dim = input.dim()
        if dim > 2:
            return _eval_batch_norm(mod, input) if input.shape[1] == mod.num_features else None
        if dim < 2:
            return None
    # Parameters and buffers read from their tables (nn.Module.__getattr__ costs ~1 µs a name); anything
    # else in their place is the general path's (its ordinary lookups).
    params, buffers = mod._parameters, mod._buffers
    weight, bias = params.get("weight", _MISSING), params.get("bias", _MISSING)
    if track:
        running_mean, running_var = buffers.get("running_mean", _MISSING), buffers.get("running_var", _MISSING)
        tracked = buffers.get("num_batches_tracked", _MISSING) if training else None
    else:
        running_mean = running_var = tracked = None
    if (weight is _MISSING or bias is _MISSING or running_mean is _MISSING or running_var is _MISSING
            or tracked is _MISSING or training and track and tracked is None
            or not use_batch_stats and (running_mean is None or running_var is None)):
        return None
    p = direct.plan(input, z, weight, bias, running_mean, running_var, tracked, mod.channel_last, mod.num_features)
    if p is None:
        return None  # (PyTorch's path, or an error: the general path's at once)
    group, distributed = mod.process_group, False
    if use_batch_stats:
        if _DIST and dist.is_initialized():
            distributed = dist.get_world_size(group) > 1
        elif group is not None:
            return None  # (require_process_group's error)
        if not distributed and p.R < 2:
            return None  # (one value per channel: the general path's error)
    factor = 0.0
    if tracked is not None:  # (training with running statistics)
        if mod.momentum is None:  # the factor needs the new count on the host
            tracked.add_(1)
            factor, tracked = 1.0 / float(tracked), None
        else:  # incremented by the statistics' kernel (no operator of its own)
            factor = mod.momentum
    gather = None
    if distributed:  # the general path's all-gather of the ranks' statistics
        from apex.parallel.sync_batchnorm import _gather_rows  # (that module imports this one)

        shape = input.shape
        gather = lambda row: _gather_rows(row, group, shape)
    return direct.forward(p, input, z, weight, bias, running_mean, running_var, tracked, mod.eps, factor,
                          bool(mod.fuse_relu), use_batch_stats, group, gather)
