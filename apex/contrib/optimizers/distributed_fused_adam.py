"""``DistributedFusedAdam``: Adam/AdamW with ZeRO-2 sharding on ``torch.distributed`` (NCCL on GPUs, Gloo on
CPUs), Apex's ``apex.contrib.optimizers.distributed_fused_adam.DistributedFusedAdam``."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict, defaultdict

import torch
import torch.distributed as dist

from apex._errors import AssertRuntimeError, RuntimeValueError  # noqa: F401  (a former name)
from apex.contrib.optimizers import _zero_buckets as zb
from apex.contrib.optimizers._gloo_collectives import (  # noqa: F401  (Apex's module-level names)
    _coalescing_manager,
    _coalescing_manager_append_work,
    _devices_match,
)
from apex.contrib.optimizers._zero_buckets import (  # noqa: F401  (Apex's module-level names)
    _bf16_rem_to_fp32,
    _disable_pre_forward_hook,
    _multi_tensor_copy,
    _round_to_multiple,
)
from apex.contrib.optimizers._zero_comm import ZeroCommMixin
from apex.contrib.optimizers._zero_deferred import ZeroDeferredGradMixin
from apex.contrib.optimizers._zero_layout import ZeroLayoutMixin
from apex.contrib.optimizers._zero_norms import ZeroNormMixin
from apex.contrib.optimizers._zero_scaled import ZeroScaledStateMixin
from apex.contrib.optimizers._zero_state_dict import ZeroStateDictMixin
from apex.contrib.optimizers._zero_step import ZeroStepMixin


def _resolve_device(device, params) -> torch.device:
    """Apex's ``device="cuda"``: the current GPU; on a machine without one, the parameters' device. Errors are
    ``ValueError`` and also the ``RuntimeError`` Apex raised for a device it could not use."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise RuntimeValueError(f"DistributedFusedAdam needs all parameters on one device, got "
                                f"{sorted(map(str, devices))}")
    dev = torch.device("cuda" if device is None else device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        dev = next(iter(devices)) if devices else torch.device("cpu")
    elif dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if devices and next(iter(devices)) != dev:
        raise RuntimeValueError(f"device={device!r} resolves to {dev}, but the parameters are on "
                                f"{next(iter(devices))}")
    return dev


class DistributedFusedAdam(ZeroLayoutMixin, ZeroCommMixin, ZeroDeferredGradMixin, ZeroStepMixin, ZeroNormMixin,
                           ZeroScaledStateMixin, ZeroStateDictMixin, torch.optim.Optimizer):
    r"""Adam (``adam_w_mode=False``) / AdamW with the ZeRO-2 algorithm, Apex's ``DistributedFusedAdam``.

    Parameters are packed into buckets (``bucket_cap_mb``); each of the ``distributed_size`` ranks of
    ``distributed_process_group`` owns one contiguous shard of every bucket. During backward, hooks run when a
    parameter's gradient is accumulated: the gradient is added into its bucket and, once every parameter of
    a bucket has one (``overlap_grad_sync``), the bucket is reduce-scattered asynchronously (averaged when
    ``average_grad_sync``), while backward continues. ``step`` waits for the reductions, updates each rank's
    shard with apex's multi-tensor Adam (``apex.ops.multi_tensor_adam``, the math of
    ``apex.optimizers.FusedAdam``; ``grad * grad_scale`` is the gradient, the scale carrying
    ``clip_grad_norm`` and ``GradScaler`` unscaling), and all-gathers the parameters (with
    ``overlap_param_sync``, asynchronously: a parameter waits for its bucket the first time a torch
    operation uses it). A ``redundant_process_group`` replicates the shards (gradients are all-reduced over it).

    Dtypes: state and master shards are ``dtype`` (fp32 by default; the update is computed in fp32),
    gradients are reduced in ``grad_sync_dtype`` and parameters gathered in ``param_sync_dtype`` (both
    default to ``dtype``; an integer ``param_sync_dtype`` sends the most significant bytes, as in Apex).
    ``store_params=True`` keeps an fp32 master shard; with ``store_params=False`` the shard is read back from
    the model parameters each step. ``store_param_remainders=True`` (bf16 parameters, fp32 state,
    ``param_sync_dtype=torch.bfloat16``) keeps the low 16 bits of each fp32 master instead: the bf16
    parameter and the int16 remainder rebuild the master exactly. ``with_scaled_states=True`` (fp16/bf16
    ``dtype``) stores the master and moments divided by a per-fragment fp32 scale. ``nccl_ub`` is accepted
    and has no effect; ``pipeline_size`` has no effect (there are no side streams: collectives are
    asynchronous ``torch.distributed`` works).

    Each rank holds ``1/distributed_size`` of the optimizer state. ``state_dict()`` (format 2) gathers the
    full per-parameter state (``param``, ``exp_avg``, ``exp_avg_sq`` in fp32 on the CPU) on every rank, so it
    loads into any world size; ``state_dict(state_dict_format=1, gather_on_root=...)`` is Apex's older
    format (per-rank state; loads only into the same world size).
    """

    ParameterFragment = zb.ParameterFragment
    StateBucket = zb.StateBucket
    GradientStatus = zb.GradientStatus
    GradientBucket = zb.GradientBucket
    ParameterStatus = zb.ParameterStatus
    ParameterBucket = zb.ParameterBucket

    _step_supports_amp_scaling: bool = True
    _custom_amp_unscale_grads: bool = True

    def __init__(self, params, lr=1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 dtype: torch.dtype = torch.float32, grad_sync_dtype: torch.dtype | None = None,
                 param_sync_dtype: torch.dtype | None = None, device="cuda", process_group=None,
                 distributed_process_group=None, redundant_process_group=None, average_grad_sync: bool = True,
                 overlap_grad_sync: bool = True, overlap_param_sync: bool = False, bucket_cap_mb: float = 100.0,
                 pipeline_size: int = 2, contiguous_param_buffer: bool = False,
                 contiguous_grad_buffer: bool = False, store_params: bool = True,
                 store_param_remainders: bool = False, with_scaled_states: bool = False, nccl_ub: bool = False,
                 capturable: bool = False):
        if amsgrad:
            raise RuntimeError("DistributedFusedAdam does not support the AMSGrad variant.")
        if (with_scaled_states or store_param_remainders) and capturable:
            raise ValueError("with_scaled_states=True and store_param_remainders=True do not support capturable=True")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedFusedAdam needs torch.distributed.init_process_group() first")
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not isinstance(value, torch.Tensor) and float(value) < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        grad_sync_dtype = dtype if grad_sync_dtype is None else grad_sync_dtype
        param_sync_dtype = dtype if param_sync_dtype is None else param_sync_dtype
        if dtype not in zb.FLOAT_DTYPES or grad_sync_dtype not in zb.FLOAT_DTYPES:
            raise ValueError(f"Unsupported dtypes for DistributedFusedAdam (dtype={dtype}, "
                             f"grad_sync_dtype={grad_sync_dtype}, param_sync_dtype={param_sync_dtype})")
        if store_param_remainders:
            if store_params:
                raise RuntimeError("Attempted to construct DistributedFusedAdam with store_params=True and "
                                   "store_param_remainders=True")
            if dtype != torch.float32 or param_sync_dtype != torch.bfloat16:
                raise RuntimeError("DistributedFusedAdam requires BF16 params and FP32 optimizer state when "
                                   f"storing parameter remainders (dtype={dtype}, "
                                   f"param_sync_dtype={param_sync_dtype})")
        if with_scaled_states and (not store_params or store_param_remainders or dtype == torch.float32
                                   or param_sync_dtype == torch.float32):
            raise RuntimeError("with_scaled_states=True needs store_params=True, store_param_remainders=False, an "
                               f"fp16/bf16 dtype and a param_sync_dtype other than fp32 (dtype={dtype}, "
                               f"param_sync_dtype={param_sync_dtype})")
        if nccl_ub and not contiguous_grad_buffer:
            raise RuntimeError("NCCL user buffers require contiguous grad buffers")
        self.capturable = bool(capturable)
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay)
        super().__init__(params, defaults)
        all_params = list(self.parameters())
        for p in all_params:
            if not p.is_floating_point() or p.is_complex():
                raise TypeError(f"DistributedFusedAdam optimizes floating-point parameters, got {p.dtype}")
        if store_param_remainders and any(p.dtype != torch.bfloat16 for p in all_params):
            raise TypeError("store_param_remainders=True needs bfloat16 parameters")
        self.device = _resolve_device(device, all_params)
        self.adam_w_mode = bool(adam_w_mode)
        self.amsgrad = False
        self.dtype, self.grad_sync_dtype, self.param_sync_dtype = dtype, grad_sync_dtype, param_sync_dtype

        self.process_group = dist.group.WORLD if process_group is None else process_group
        self.distributed_process_group = (self.process_group if distributed_process_group is None
                                          else distributed_process_group)
        self.redundant_process_group = redundant_process_group
        backend = dist.get_backend(self.process_group)
        if backend == "nccl" and self.device.type != "cuda":
            raise ValueError(f"process group backend 'nccl' cannot communicate {self.device} parameters")
        self.process_group_size = dist.get_world_size(self.process_group)
        self.distributed_rank = dist.get_rank(self.distributed_process_group)
        self.distributed_size = dist.get_world_size(self.distributed_process_group)
        self.redundant_size = 1 if redundant_process_group is None else dist.get_world_size(redundant_process_group)
        if self.process_group_size != self.distributed_size * self.redundant_size:
            raise RuntimeError(f"Invalid process group configuration (process group size = "
                               f"{self.process_group_size}, distributed process group size = "
                               f"{self.distributed_size}, redundant process group size = {self.redundant_size})")
        self.process_group_root = dist.get_global_rank(self.process_group, 0) \
            if self.process_group is not dist.group.WORLD else 0

        self.average_grad_sync = bool(average_grad_sync)
        self.greedy_grad_copy = True
        self.overlap_grad_sync = bool(overlap_grad_sync)
        self.overlap_param_sync = bool(overlap_param_sync)
        self.pipeline_size = int(pipeline_size)
        self.store_params = bool(store_params)
        self.store_param_remainders = bool(store_param_remainders)
        self.with_scaled_states = bool(with_scaled_states)
        self._state_scales: dict = {}
        self.nccl_ub = bool(nccl_ub)

        dtype_size = torch.finfo(self.grad_sync_dtype).bits // 8
        self.alignment = 128 // dtype_size
        self.bucket_cap_mb = bucket_cap_mb
        shard_size = int(1024 * 1024 * bucket_cap_mb / dtype_size / self.distributed_size)
        self.default_shard_size = max(_round_to_multiple(shard_size, self.alignment, round_up=False), self.alignment)

        self.state["buckets"] = []
        self._buckets_shrunk = False
        self.state["step"] = torch.zeros([1], dtype=torch.int32, device=self.device) if self.capturable else 0
        self._grads_buckets: dict = defaultdict(self.GradientBucket)
        self._params_buckets: OrderedDict = OrderedDict()
        self.contiguous_param_buffer = bool(contiguous_param_buffer)
        self.contiguous_grad_buffer = bool(contiguous_grad_buffer)
        self._param_buffers: dict = {}
        self._grad_buffers: dict = {}
        self._comm_buffers: dict = {}  # (purpose, bucket id) -> a buffer reused every step (see _comm_buffer)
        self._param_copy_cache: dict = {}  # fragment ids -> the views _param_copy_fragments copies between
        self._grad_views: dict = {}  # id(fragment) -> what _grad_copy keeps for it between steps
        self._deferred_plans: dict = {}  # id(param) -> where the hook's fast path queues its gradient
        self._deferred_flush_queued = False  # a flush is registered for the end of the running backward
        self._has_deferred = False  # some bucket may hold queued gradients
        self._copy_flags: dict = {}  # device -> the (unread) inf flag of the queued gradients' copies
        self._pre_forward_armed = False  # parameters may carry armed pre-forward hooks (overlap_param_sync)
        self._grad_scale = torch.full([], 1.0, dtype=torch.float32, device=self.device)
        self._grad_norm: torch.Tensor | None = None
        self._dummy_overflow_buf = torch.zeros([1], dtype=torch.int32, device=self.device)
        if self.capturable:
            for group in self.param_groups:
                group["lr"] = torch.as_tensor(group["lr"], dtype=torch.float32).to(self.device)

        self._broadcast_params()
        self._lock = threading.RLock()
        self._register_post_backward_hooks()
        self.comm_stats = {"reduce_scatter_bytes": 0, "all_gather_bytes": 0, "all_reduce_bytes": 0}

    # -- structure ---------------------------------------------------------------------------------------

    def parameters(self):
        """All parameters of the optimizer, group by group."""
        return itertools.chain.from_iterable(group["params"] for group in self.param_groups)

    def parameter(self, *args) -> torch.nn.Parameter:
        """The parameter ``(param_group_id, param_id)``, or the one a ``ParameterFragment`` belongs to."""
        if len(args) == 2 and all(isinstance(a, int) for a in args):
            return self.param_groups[args[0]]["params"][args[1]]
        if len(args) == 1 and isinstance(args[0], self.ParameterFragment):
            return self.param_groups[args[0].param_group_id]["params"][args[0].param_id]
        raise TypeError("Expected input types are [int, int] or [DistributedFusedAdam.ParameterFragment], "
                        f"but found {[type(a).__name__ for a in args]}")

    def _id_map(self) -> dict:
        return {p: (gi, pi) for gi, g in enumerate(self.param_groups) for pi, p in enumerate(g["params"])}

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Start every rank from the root's parameter values."""
        works = [dist.broadcast(p.data, src=self.process_group_root, group=self.process_group, async_op=True)
                 for p in self.parameters()]
        for w in works:
            w.wait()

    def _register_post_backward_hooks(self) -> None:
        self._grad_accs = []
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if p.requires_grad:
                    self._grad_accs.append(p.register_post_accumulate_grad_hook(self._make_post_backward_hook(
                        p, gi, pi)))

    def _make_post_backward_hook(self, param, param_group_id: int, param_id: int):
        def post_backward_hook(*unused) -> None:
            with self._lock:
                if self._defer_grad_copy(param):  # the usual case from the second step on (_zero_deferred)
                    return
                new = "fragments" not in self.state[param]
                if new:
                    self._init_param_state(param, param_group_id, param_id)
                if self.greedy_grad_copy:
                    self._grad_copy(param)
                    if self.overlap_grad_sync:
                        self._try_start_bucket_grad_sync(params=[param], ignore_last_bucket=new)
                        self._plan_deferred_grad_copy(param)
        return post_backward_hook

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Clear gradients, the gradient buckets, the cached norm and the gradient scale."""
        self._finish_bucket_grad_sync()
        for gb in self._grads_buckets.values():  # gradients queued by a backward that did not finish
            for q, _ in gb.deferred:
                q.grad = None
        self._has_deferred = self._deferred_flush_queued = False
        self._grads_buckets.clear()
        if self.contiguous_grad_buffer:
            if not self._grad_buffers:
                self._init_grad_buffer()
            for buf in self._grad_buffers.values():
                buf.zero_()
            for bucket_id, b in enumerate(self.state["buckets"]):
                start = b.contiguous_buffer_offset
                buf = self._grad_buffers[b.dtypes()]
                self._grads_buckets[bucket_id].grads_bucket = buf[start:start + b.bucket_size]
        # Touching .grad is not a use of the parameter: no pending parameter sync (overlap_param_sync) may
        # run for it, and none of its per-parameter Python (__torch_function__) is paid.
        with torch._C.DisableTorchFunctionSubclass():
            for p in self.parameters():
                if set_to_none:
                    p.grad = None
                    continue
                if self.contiguous_grad_buffer:
                    b = self.state["buckets"][self.state[p]["fragments"][0].bucket_id]
                    if p.dtype == b.grad_sync_dtype and p.device == self.device:
                        p.grad = self.grad_buffer_view(p)
                        continue
                if p.grad is not None:
                    p.grad.zero_()
        self._grad_scale.fill_(1.0)
        self._grad_norm = None
        self._dummy_overflow_buf.zero_()

    @contextlib.contextmanager
    def no_sync(self, greedy_grad_copy: bool = False):
        """Accumulate gradients without communicating (like DDP's ``no_sync``); they are reduced by the next
        backward outside the context, ``grad_sync`` or ``step``."""
        old = self.greedy_grad_copy, self.overlap_grad_sync
        self.greedy_grad_copy, self.overlap_grad_sync = greedy_grad_copy, False
        try:
            yield
        finally:
            self.greedy_grad_copy, self.overlap_grad_sync = old
