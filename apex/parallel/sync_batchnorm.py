"""``SyncBatchNorm``: batch normalisation whose statistics cover the batch of every rank of a group.

Forward: each rank computes its per-channel ``(count, mean, biased var)``; one ``all_gather`` shares them
and a parallel Welford merge gives the group's statistics, exact for unequal per-rank batch sizes::

    n = Σ n_i,  mean = Σ n_i mean_i / n,  var = Σ n_i (var_i + (mean_i - mean)²) / n

Backward: one ``all_reduce`` of the two per-channel sums ``[Σ dy, Σ dy (x - mean)]``; ``grad_weight`` and
``grad_bias`` stay local (DistributedDataParallel averages them like any other gradient).

Running statistics use the unbiased variance ``var * n / (n - 1)`` of the whole group and
``momentum`` (``None``: cumulative average over the batches seen). Statistics and the elementwise passes
run in fp32 whatever the input dtype; the output has the input's dtype. On GPUs they are Triton kernels,
on the CPU PyTorch ops (``apex.ops.sync_batch_norm``); collectives use ``torch.distributed`` (Gloo/NCCL).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from apex import _backend
from apex.ops import sync_batch_norm as ops
from apex.parallel._comm import require_process_group
from apex.parallel._syncbn_direct import check_count as _check_count
from apex.parallel._syncbn_direct import gather_rows as _gather_rows
from apex.parallel._syncbn_direct import module_forward as _direct_forward


def _merge_stats(count: int, mean: torch.Tensor, var: torch.Tensor, group):
    """All-gather ``(count, mean, var)`` over ``group`` and merge them (parallel Welford, in fp64)."""
    acc = mean.dtype
    C = mean.numel()
    mine = torch.cat([torch.tensor([float(count)], dtype=torch.float64, device=mean.device),
                      mean.double(), var.double()])
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    allstats = torch.stack(gathered)
    n_i = allstats[:, :1]
    mean_i = allstats[:, 1:1 + C]
    var_i = allstats[:, 1 + C:]
    n = n_i.sum()
    if n == 0:
        raise ValueError("SyncBatchNorm got an empty batch on every rank")
    gmean = (n_i * mean_i).sum(0) / n
    gvar = (n_i * (var_i + (mean_i - gmean) ** 2)).sum(0) / n
    return int(n.item()), gmean.to(acc), gvar.to(acc)


def _fused_forward(ctx, input, z, weight, bias, running_mean, running_var, eps, use_batch_stats, momentum,
                   process_group, channel_last, fuse_relu, distributed, tracked=None):
    """The Triton path: statistics, running-statistics update and scale/shift finished in kernels, on the
    contiguous input as it is (no per-channel operators, no views); ``tracked`` (the module's
    ``num_batches_tracked``, or None) incremented by the statistics' kernel."""
    ncl = ops.ncl_sizes(input, channel_last)
    x = input.contiguous()
    zz = None if z is None else z.contiguous().to(x.dtype)
    if not use_batch_stats:
        count = 0
        st = ops.eval_stats(ncl[1], weight, bias, running_mean, running_var, eps, x)
    elif distributed:
        count, st = ops.train_stats(x, ncl, weight, bias, running_mean, running_var, eps, momentum,
                                    lambda row: _gather_rows(row, process_group, input.shape), tracked)
    else:
        if ncl[0] * ncl[2] <= 1:
            _check_count(ncl[0] * ncl[2], input.shape)
        count, st = ops.train_stats(x, ncl, weight, bias, running_mean, running_var, eps, momentum, None, tracked)
    y = ops.normalize(x, ncl, st, zz, fuse_relu)
    if ctx is not None:  # (None: called without autograd, nothing to save)
        ctx.save_for_backward(x, zz, weight, bias, st)
        ctx.meta = (count, use_batch_stats, process_group, distributed, fuse_relu, ncl, True)
    return y


def _fused_ok(input, weight, bias, running_mean, running_var, backend: str | None = None) -> bool:
    """Whether the Triton path takes this call (the kernels read contiguous parameters and statistics);
    ``backend``: ``ops.backend(input)`` when the caller has it."""
    return bool(input.numel() and (backend or ops.backend(input)) == "triton"
                and (weight is None or weight.is_contiguous())
                and (bias is None or bias.is_contiguous())
                and (running_mean is None or (running_mean.is_contiguous() and running_var.is_contiguous())))


def _fused_backward(ctx, grad_output, need_x, need_z, need_w, need_b):
    """The Triton path: both sums, grad_weight and grad_bias from one reduction and one finishing kernel; the
    group's means of the sums are taken inside the elementwise kernel."""
    x, zz, weight, bias, st = ctx.saved_tensors
    if not (x.is_contiguous() and st.is_contiguous() and (zz is None or zz.is_contiguous())):
        # The kernels read these as the forward made them, contiguous; a saved-tensor hook may give them back in
        # another layout.
        x, st = x.contiguous(), st.contiguous()
        zz = None if zz is None else zz.contiguous()
    count, use_batch_stats, group, distributed, fuse_relu, ncl, _ = ctx.meta
    dy = grad_output.contiguous()
    grad_weight = torch.empty_like(weight) if weight is not None and need_w else None
    grad_bias = torch.empty_like(bias) if bias is not None and need_b else None
    ws = ops.backward_sums(dy, x, ncl, st, zz, fuse_relu, grad_weight, grad_bias)
    dx = dz = None
    if need_x or need_z:
        if use_batch_stats and distributed:
            dist.all_reduce(ws[:2], group=group)
        dx, dz = ops.backward_elemt_sums(dy, x, ncl, st, ws, count if use_batch_stats else None, zz, fuse_relu,
                                         need_z)
    return (dx if need_x else None, dz, grad_weight, grad_bias) + (None,) * 11


class SyncBatchnormFunction(torch.autograd.Function):
    """Autograd function of :class:`SyncBatchNorm` (argument order as in Apex, plus ``z``/``fuse_relu``;
    ``num_batches_tracked``: the module's counter, incremented by one here, or None; ``fused``: whether the
    Triton path takes the call, where the caller has asked already)."""

    @staticmethod
    def forward(ctx, input, z, weight, bias, running_mean, running_var, eps, use_batch_stats, momentum,
                process_group, channel_last, fuse_relu, distributed, num_batches_tracked=None, fused=None):
        if z is not None:  # before either path updates the running statistics (the module checked it already)
            ops.check_devices(input, ("z", z))
        if fused if fused is not None else _fused_ok(input, weight, bias, running_mean, running_var):
            return _fused_forward(ctx, input, z, weight, bias, running_mean, running_var, eps, use_batch_stats,
                                  momentum, process_group, channel_last, fuse_relu, distributed, num_batches_tracked)
        if num_batches_tracked is not None:
            num_batches_tracked.add_(1)
        x = ops.as_ncl(input, channel_last)
        zz = ops.as_ncl(z, channel_last).to(x.dtype) if z is not None else None
        C = x.shape[1]
        if use_batch_stats:
            count = x.shape[0] * x.shape[2]
            if count > 0:
                mean, var = ops.batch_norm_stats(x)
            else:
                mean = var = torch.zeros(C, dtype=ops.acc_dtype(x), device=x.device)
            if distributed:
                count, mean, var = _merge_stats(count, mean, var, process_group)
            _check_count(count, input.shape)
            invstd = torch.rsqrt(var + eps)
            if running_mean is not None and momentum > 0:
                with torch.no_grad():
                    unbiased = var * (count / (count - 1))
                    if running_mean.dtype == mean.dtype == running_var.dtype:
                        # The same two operators on both buffers in two calls instead of four.
                        running = [running_mean, running_var]
                        torch._foreach_mul_(running, 1 - momentum)
                        torch._foreach_add_(running, [mean, unbiased], alpha=momentum)
                    else:
                        running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        else:
            count = 0
            mean = running_mean.to(ops.acc_dtype(x))
            invstd = torch.rsqrt(running_var.to(ops.acc_dtype(x)) + eps)
        # The per-channel affine map, computed once for the forward and both backward passes.
        scale, shift = ops.scale_shift(x, mean, invstd, weight, bias)
        y = ops.batch_norm_elemt(x, mean, invstd, weight, bias, zz, fuse_relu, (scale, shift)) if x.numel() \
            else x.clone()
        ctx.save_for_backward(x, zz, weight, bias, mean, invstd, scale, shift)
        ctx.meta = (count, use_batch_stats, process_group, distributed, fuse_relu, input.shape, False)
        if y.shape == input.shape and y._base is None:
            return y  # already the output's shape and no view (a reshape and detach cost ~4 µs)
        # detach(): the reshape is a view of a tensor made here, which autograd would refuse to let an
        # in-place op (nn.ReLU(inplace=True) after the norm) modify; a detached alias has no such base.
        return y.reshape(input.shape).detach()

    @staticmethod
    def backward(ctx, grad_output):
        count, use_batch_stats, group, distributed, fuse_relu, shape, fused = ctx.meta
        need_x, need_z, need_w, need_b = ctx.needs_input_grad[:4]
        if fused:
            return _fused_backward(ctx, grad_output, need_x, need_z, need_w, need_b)
        x, zz, weight, bias, mean, invstd, scale, shift = ctx.saved_tensors
        dy = grad_output.contiguous()
        if dy.shape != x.shape:
            dy = dy.reshape(x.shape)
        if fuse_relu and x.numel() and (x.dtype == torch.float64 or _backend.select(x) == "torch"):
            # Mask once here instead of in each of the two backward passes.
            dy = ops.relu_grad(dy, x, mean, invstd, weight, bias, zz)
            fuse_relu, zz = False, None
        C = x.shape[1]
        if x.numel():
            sum_dy, sum_dy_xmu = ops.batch_norm_backward_reduce(dy, x, mean, invstd, weight, bias, zz,
                                                                fuse_relu, (scale, shift))
        else:
            sum_dy = sum_dy_xmu = torch.zeros(C, dtype=ops.acc_dtype(x), device=x.device)
        grad_input = grad_z = grad_weight = grad_bias = None
        if weight is not None and need_w:
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
        if bias is not None and need_b:
            grad_bias = sum_dy.to(bias.dtype)
        if need_x or need_z:
            if use_batch_stats and distributed:
                sums = torch.cat([sum_dy, sum_dy_xmu])  # one collective for both
                dist.all_reduce(sums, group=group)
                mean_dy, mean_dy_xmu = (sums / count).split(C)
            elif use_batch_stats:
                mean_dy, mean_dy_xmu = sum_dy / count, sum_dy_xmu / count
            else:
                mean_dy = mean_dy_xmu = torch.zeros(C, dtype=ops.acc_dtype(x), device=x.device)
            if x.numel():
                dx, dz = ops.batch_norm_backward_elemt(dy, x, mean, invstd, weight, bias, mean_dy,
                                                       mean_dy_xmu, zz, fuse_relu, need_dz=need_z,
                                                       scale_shift=(scale, shift))
            else:
                dx, dz = dy.clone(), dy.clone()
            same = x.shape == shape  # a 3-D input: no reshape back
            grad_input = (dx if same else dx.reshape(shape)) if need_x else None
            grad_z = (dz if same else dz.reshape(shape)) if need_z else None
        return (grad_input, grad_z, grad_weight, grad_bias) + (None,) * 11


_sync_bn_apply = super(torch.autograd.Function, SyncBatchnormFunction).apply


class SyncBatchNorm(_BatchNorm):
    """Batch normalisation with statistics reduced over a process group (Apex's ``SyncBatchNorm``).

    In training mode the mean and variance cover the concatenated batch of every rank of
    ``process_group`` (the default group when ``None``); in eval mode the running statistics are used
    (plain batch norm). Without an initialised process group and with ``process_group=None`` it is plain
    ``BatchNorm`` on the local batch; with a ``process_group`` but no initialised process group, training
    raises RuntimeError. Initialise with ``torch.distributed.init_process_group(..., timeout=...)``: the
    timeout makes a dead rank fail the others instead of hanging them.

    Args:
        num_features: ``C`` of an input ``(N, C, *)`` (or ``(*, C)`` with ``channel_last``).
        eps: added to the variance. momentum: running-stats factor (``None``: cumulative average).
        affine: learnable ``weight`` and ``bias``. track_running_stats: keep running statistics (else
            batch statistics are used in eval mode too).
        process_group: the group to synchronise over. channel_last: the channel is the last dimension
            (2-D inputs ``(N, C)`` are the same in both layouts).
        fuse_relu: apply ReLU to the output (after the residual ``z``).

    ``forward(input, z=None)``: ``out = relu?(batch_norm(input) + z)``.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None,
                 channel_last: bool = False, fuse_relu: bool = False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _specify_process_group(self, process_group) -> None:
        self.process_group = process_group

    def _specify_channel_last(self, channel_last: bool) -> None:
        self.channel_last = channel_last

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input with at least 2 dimensions, got {input.dim()}")

    def extra_repr(self) -> str:
        return (super().extra_repr() + f", channel_last={self.channel_last}, fuse_relu={self.fuse_relu}")

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        # The usual eager call first: the Triton path's facts from the plan of the call's layout (the module's last
        # one, where its guard passes), or PyTorch's eval-mode batch norm; None where it does not apply.
        # Compiling traces the general path below.
        if not torch.compiler.is_compiling() and type(input) is torch.Tensor:
            y = _direct_forward(self, input, z)
            if y is not None:
                return y
        self._check_input_dim(input)
        channel_last = self.channel_last or input.dim() == 2
        c_dim = input.dim() - 1 if channel_last else 1
        if input.shape[c_dim] != self.num_features:
            raise ValueError(f"expected {self.num_features} channels in dimension {c_dim} of the input, got "
                             f"shape {tuple(input.shape)}")
        if z is not None and z.shape != input.shape:
            raise ValueError(f"z must have the input's shape {tuple(input.shape)}, got {tuple(z.shape)}")
        if z is not None:  # before the statistics' kernel updates the running statistics
            ops.check_devices(input, ("z", z))
        use_batch_stats = self.training or not self.track_running_stats
        # Parameters and buffers read from their tables (nn.Module.__getattr__ costs ~1 µs a name, and a
        # training step reads six); anything else put in their place by the ordinary lookup.
        params, buffers = self._parameters, self._buffers
        weight = params["weight"] if "weight" in params else self.weight
        bias = params["bias"] if "bias" in params else self.bias
        if self.track_running_stats:
            running_mean = buffers["running_mean"] if "running_mean" in buffers else self.running_mean
            running_var = buffers["running_var"] if "running_var" in buffers else self.running_var
        else:
            running_mean = running_var = None
        if (not use_batch_stats and not channel_last and z is None and not self.fuse_relu):
            return F.batch_norm(input, self.running_mean, self.running_var, weight, bias, False, 0.0, self.eps)
        distributed = False
        if use_batch_stats:
            if dist.is_available() and dist.is_initialized():
                distributed = dist.get_world_size(self.process_group) > 1
            elif self.process_group is not None:
                require_process_group("apex.parallel.SyncBatchNorm with a process_group in training mode")
        factor, tracked = 0.0, None
        if self.training and self.track_running_stats:
            tracked = buffers["num_batches_tracked"] if "num_batches_tracked" in buffers else self.num_batches_tracked
            if self.momentum is None:  # the factor needs the new count on the host
                tracked.add_(1)
                factor, tracked = 1.0 / float(tracked), None
            else:  # incremented below: on the Triton path by its statistics kernel (one operator less)
                factor = self.momentum
        # The backend once; the kernels' path is PyTorch's for fp64 (apex.ops.sync_batch_norm.backend).
        selected = _backend.select_tensor(input)
        if (selected == "torch" and use_batch_stats and not distributed and input.numel()
                and input.dim() in (2, 3, 4) and input.dtype in (torch.float32, torch.float64)
                and (weight is None or weight.dtype == input.dtype)
                and (z is None or z.dtype == input.dtype)):
            # Nothing to synchronise, on the PyTorch path: PyTorch's batch norm computes the same
            # statistics, running-stat update and gradients in fused passes (torch.nn.SyncBatchNorm falls
            # back to it in the same case).
            if tracked is not None:
                tracked.add_(1)
            return self._local_batch_norm(input, z, channel_last, running_mean, running_var,
                                          factor if self.training else 0.0)
        # Outside torch.func transforms and tracing, the C++ Function.apply without its Python wrapper (which
        # unwraps torch.func's dead wrappers over all 13 arguments, ~5 µs).
        plain = not (torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling())
        if not plain and tracked is not None:  # an operator the tracer sees, not a write inside a kernel
            tracked.add_(1)
            tracked = None
        be = "torch" if input.dtype == torch.float64 else selected
        fused = _fused_ok(input, weight, bias, running_mean, running_var, be)  # asked once, told to the Function
        if fused and plain and not (torch.is_grad_enabled() and torch._C._any_requires_grad(input, z, weight, bias)):
            # Nothing to record: the Triton path's kernels without the Function's context and saved tensors.
            return _fused_forward(None, input, z, weight, bias, running_mean, running_var, self.eps,
                                  use_batch_stats, factor if self.training else 0.0, self.process_group,
                                  channel_last, self.fuse_relu, distributed, tracked)
        apply = _sync_bn_apply if plain else SyncBatchnormFunction.apply
        return apply(input, z, weight, bias, running_mean, running_var, self.eps, use_batch_stats,
                     factor if self.training else 0.0, self.process_group, channel_last, self.fuse_relu,
                     distributed, tracked, fused)

    def _local_batch_norm(self, input, z, channel_last, running_mean, running_var, momentum):
        move = channel_last and input.dim() > 2  # (N, L, C) or (N, H, W, C): the channel to dim 1 (a view)
        x = input.movedim(-1, 1) if move else input
        y = F.batch_norm(x, running_mean, running_var, self.weight, self.bias, True, momentum, self.eps)
        if move:
            y = y.movedim(1, -1).contiguous()
        if z is not None:
            y = y + z
        return F.relu(y) if self.fuse_relu else y


def convert_syncbn_model(module: torch.nn.Module, process_group=None, channel_last: bool = False):
    """Replace every ``torch.nn.modules.batchnorm._BatchNorm`` in ``module`` by :class:`SyncBatchNorm`.

    Parameters are copied, running statistics and ``num_batches_tracked`` are kept (the same tensors),
    and device, dtype and training mode carry over; instance norms are left alone. Returns the new
    module (``module`` itself when it is not a batch norm).
    """
    mod = module
    if isinstance(module, _BatchNorm):
        mod = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last=channel_last,
                            fuse_relu=getattr(module, "fuse_relu", False))
        if module.track_running_stats:
            mod.running_mean = module.running_mean
            mod.running_var = module.running_var
            mod.num_batches_tracked = module.num_batches_tracked
        if module.affine:
            with torch.no_grad():
                mod.weight = torch.nn.Parameter(module.weight.detach().clone(),
                                                requires_grad=module.weight.requires_grad)
                mod.bias = torch.nn.Parameter(module.bias.detach().clone(),
                                              requires_grad=module.bias.requires_grad)
        mod.train(module.training)
    for name, child in module.named_children():
        mod.add_module(name, convert_syncbn_model(child, process_group=process_group,
                                                  channel_last=channel_last))
    return mod


def create_syncbn_process_group(group_size: int):
    """Split the world into consecutive groups of ``group_size`` ranks; return the caller's group.

    ``group_size=0`` means the whole world (returns None, i.e. the default group). Every rank must call
    this (creating groups is collective). ``group_size`` must divide the world size (ValueError).
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 0:
        raise ValueError(f"group_size must be a non-negative int, got {group_size!r}")
    if group_size == 0:
        return None
    require_process_group("apex.parallel.create_syncbn_process_group")
    world_size = dist.get_world_size()
    if group_size > world_size or world_size % group_size != 0:
        raise ValueError(f"group_size ({group_size}) must divide the world size ({world_size})")
    group = None
    rank = dist.get_rank()
    for g in range(world_size // group_size):
        ranks = list(range(g * group_size, (g + 1) * group_size))
        pg = dist.new_group(ranks=ranks)  # every rank creates every group (collective)
        if rank // group_size == g:
            group = pg
    return group
