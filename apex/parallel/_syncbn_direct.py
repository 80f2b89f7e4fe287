"""The usual eager call of :class:`apex.parallel.SyncBatchNorm`, its host work cut to the module's state, a few
checks, the allocations and the launches.

:func:`module_forward` reads the module's state at each call (training, momentum, eps, fuse_relu, the
process group, parameters and buffers: any can change between calls; from the instance's ``__dict__`` where
its class leaves those names to it), asks the backend, and takes the plan of the call's layout from the Triton
path's lean dispatch, ``apex.ops._syncbn_direct``: the plan the module took last where the call has its
options and its tensors pass one of the plan's guards (one C call), else the plan of the call's key (its
tensors checked). It then launches the plan's kernels and records the autograd Function. Channel-first eval
calls get the general path's ``F.batch_norm`` directly.

Anything else (PyTorch's path, fp64, an empty input, a tensor subclass, torch.compile, functorch
transforms, tracing, parameters the kernels cannot read) and every call that an error would answer takes
the general path of ``SyncBatchNorm.forward``, which raises the errors in its own order: the lean path
changes nothing before it hands a call over. Both paths share :func:`gather_rows` (the ranks' statistics).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from apex.ops import _syncbn_direct as direct
from apex.ops._lean import triton_takes as _triton_takes
from apex.ops.sync_batch_norm import _kernels

_MISSING = object()
_DIST = dist.is_available()
_functorch_active = torch._C._are_functorch_transforms_active
_tracing_state = torch._C._get_tracing_state
_grad_enabled = torch.is_grad_enabled
_hints, _lookup, _apply, _apply_z = direct.HINTS, direct.lookup, direct.direct_apply, direct.direct_apply_z

# The state read from the module's __dict__ (nn.Module's __getattr__ hook makes each attribute read cost ~450
# instructions, a dict lookup ~80): the same values wherever the class defines none of these names (a property
# would take precedence over the instance's value) and no __getattribute__ of its own. Classes checked once.
_STATE = ("training", "track_running_stats", "channel_last", "fuse_relu", "num_features", "eps", "momentum",
          "process_group", "_parameters", "_buffers")
_PLAIN_CLASSES: set = set()  # (the classes found so)
_OTHER_CLASSES: set = set()  # (the others)


def _plain_class(cls: type) -> bool:
    """Whether reading ``_STATE`` from an instance's ``__dict__`` is reading its attributes, for ``cls`` (not in
    ``_PLAIN_CLASSES``)."""
    if cls in _OTHER_CLASSES:
        return False
    plain = cls.__getattribute__ is object.__getattribute__ and not any(
        name in vars(k) for k in cls.__mro__ for name in _STATE)
    if len(_PLAIN_CLASSES) + len(_OTHER_CLASSES) >= 256:  # classes made on the fly: stay bounded
        _PLAIN_CLASSES.clear()
        _OTHER_CLASSES.clear()
    (_PLAIN_CLASSES if plain else _OTHER_CLASSES).add(cls)
    return plain


def _default_group_reader() -> object | None:
    """How a call asks whether the default process group is initialized: ``dist.is_initialized()`` reads
    ``_world.default_pg`` through two properties (three Python frames, ~1,500 instructions); where this
    PyTorch keeps it as ``distributed_c10d._world._default_pg`` behind those properties, that attribute is
    read instead (the module and the object read at each call, so that a replaced one is seen)."""
    if not _DIST:
        return None
    try:
        from torch.distributed import distributed_c10d as c10d

        world_cls = type(c10d._world)
        if (isinstance(vars(world_cls).get("default_pg"), property) and "_default_pg" in vars(c10d._world)
                and (c10d._world._default_pg is None) == (not dist.is_initialized())):
            return c10d
    except Exception:  # (another layout: the public function)
        pass
    return None


_C10D = _default_group_reader()


def check_count(count: int, shape: tuple) -> None:
    """The error of a training call with at most one value per channel (the group's, with ranks)."""
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {tuple(shape)}")


def gather_rows(row: torch.Tensor, group: object, shape: tuple) -> tuple[torch.Tensor, int]:
    """All-gather each rank's fp64 row ``[count, mean (C), var (C)]`` into one ``[world, 1 + 2C]`` tensor (the
    collective writes each rank's row into its view) and return it with the group's count: both paths' step
    between the statistics' two finishing launches, with ranks."""
    world = dist.get_world_size(group)
    rows = torch.empty((world, row.numel()), dtype=row.dtype, device=row.device)
    dist.all_gather(list(rows.unbind(0)), row, group=group)
    count = int(sum(rows[:, 0].tolist()))
    if count == 0:
        raise ValueError("SyncBatchNorm got an empty batch on every rank")
    check_count(count, shape)
    return rows, count


def _eval_batch_norm(params: dict, buffers: dict, input: torch.Tensor, eps: float) -> torch.Tensor | None:
    """The general path's ``F.batch_norm`` call in eval mode on the module's tables (None where something else is
    in their place)."""
    weight, bias = params.get("weight", _MISSING), params.get("bias", _MISSING)
    running_mean, running_var = buffers.get("running_mean", _MISSING), buffers.get("running_var", _MISSING)
    if weight is _MISSING or bias is _MISSING or running_mean is _MISSING or running_var is _MISSING:
        return None
    return F.batch_norm(input, running_mean, running_var, weight, bias, False, 0.0, eps)


def module_forward(mod, input: torch.Tensor, z: torch.Tensor | None) -> torch.Tensor | None:
    """``SyncBatchNorm.forward(input, z)`` (a plain tensor, not compiling: the caller's tests) where the Triton
    path or, in channel-first eval mode, PyTorch's batch norm takes it; None, having changed nothing, where
    the general path must take it, including every call it answers with an error."""
    if type(mod) not in _PLAIN_CLASSES and not _plain_class(type(mod)):
        return None  # (its attributes may not be its __dict__'s: the general path's ordinary lookups)
    state = mod.__dict__
    try:
        training, track = state["training"], state["track_running_stats"]
        channel_last, fuse_relu = state["channel_last"], state["fuse_relu"]
        params, buffers = state["_parameters"], state["_buffers"]
        num_features, eps, momentum, group = (state["num_features"], state["eps"], state["momentum"],
                                              state["process_group"])
    except KeyError:
        return None  # (an attribute deleted or held elsewhere: the general path's lookups and errors)
    use_batch_stats = training or not track
    if not (use_batch_stats or z is not None or channel_last or fuse_relu):
        # Eval: channel-first, PyTorch's batch norm, as on the general path (whose checks pass: at least 3
        # dimensions, C in dimension 1), before any plan (this call needs no Triton); 2-D, the kernels.
        dim = input.dim()
        if dim > 2:
            return _eval_batch_norm(params, buffers, input, eps) if input.shape[1] == num_features else None
        if dim < 2:
            return None
    # Parameters and buffers read from their tables; anything else in their place is the general path's.
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
    # The backend first (another backend's call pays for no plan; its error is the general path's to raise),
    # then what functorch transforms or a tracer see (the general path's Function); neither is planned.
    if not _triton_takes(input.is_cuda, input):
        return None
    if _functorch_active() or _tracing_state() is not None:
        return None
    # The tensors a plan's guards check and which of them are absent (``form``: see SyncPlan).
    if z is None and weight is not None and bias is not None and running_mean is not None \
            and running_var is not None:  # (an affine module with running statistics, the usual call)
        if tracked is None:
            form, ts = 1, (input, weight, bias, running_mean, running_var)
        else:
            form, ts = 2, (input, weight, bias, running_mean, running_var, tracked)
    else:
        form = (z is None, weight is None, bias is None, running_mean is None, running_var is None, tracked is None)
        ts = tuple([t for t in (input, z, weight, bias, running_mean, running_var, tracked) if t is not None])
    p = _hints.get(id(mod))
    # The plan this module took last where this call has its options and its tensors pass one of its guards
    # (every fact of its key and of the tensor checks), else the plan of the call's key.
    if (p is None or p.form != form or p.channel_last != channel_last or p.num_features != num_features
            or not p.guards or not (p.guards[0].check(*ts) or len(p.guards) > 1 and p.guards[1].check(*ts))):
        p = _lookup(input, z, weight, bias, running_mean, running_var, tracked, channel_last, num_features, form,
                    ts)
        if p is None:
            return None  # (PyTorch's path, or an error: the general path's at once)
        if len(_hints) >= 4096:  # modules made and dropped (ids reused or not): stay bounded
            _hints.clear()
        _hints[id(mod)] = p
    distributed = False
    if use_batch_stats:
        if _DIST and (_C10D._world._default_pg is not None if _C10D is not None else dist.is_initialized()):
            distributed = dist.get_world_size(group) > 1
        elif group is not None:
            return None  # (require_process_group's error)
        if not distributed and p.R < 2:
            return None  # (one value per channel: the general path's error)
    # -------------------------------------------------- from here on the call is the Triton path's: it launches
    factor = 0.0
    if tracked is not None:  # (training with running statistics)
        if momentum is None:  # the factor needs the new count on the host
            tracked.add_(1)
            factor, tracked = 1.0 / float(tracked), None
        else:  # incremented by the statistics' kernel (no operator of its own)
            factor = momentum
    kp = p.kp
    # What the kernels read (and the backward keeps), made without recording a copy in the graph.
    x = input if p.contig else input.detach().contiguous()
    zz = None
    if z is not None:
        zz = z if z.dtype == x.dtype and z.is_contiguous() else z.detach().contiguous().to(x.dtype)
    fuse_relu = True if fuse_relu else False
    if not use_batch_stats:
        count, st = None, _kernels().eval_stats(kp.C, weight, bias, running_mean, running_var, eps)
    elif distributed:  # the general path's all-gather of the ranks' statistics
        shape = input.shape
        count, st = kp.train_stats(x, weight, bias, running_mean, running_var, eps, factor,
                                   lambda row: gather_rows(row, group, shape), tracked)
    else:  # the plan's train_stats for the local batch, its two steps here (a frame less)
        ws = kp.stats(x)
        st = ws.new_empty(4, kp.C)
        kp.finish(ws, st, weight, bias, running_mean, running_var, tracked, eps, factor)
        count = kp.R
    y = kp.normalize(x, zz, st, fuse_relu)
    # Grad mode alone decides (no requires_grad read): the Function's output needs no gradient where none of its
    # inputs does, as the plain output (only its ctx, dropped, is the difference).
    if not _grad_enabled():
        return y  # nothing to record: no Function, nothing saved
    if z is None:  # (a Function of four arguments: the C++ apply's bookkeeping of one argument less)
        return _apply(input, weight, bias, (y, st, x, None, (kp, count, fuse_relu, group, distributed)))
    return _apply_z(input, z, weight, bias, (y, st, x, zz, (kp, count, fuse_relu, group, distributed)))
