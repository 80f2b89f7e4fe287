"""``DistributedFusedLAMB``: Apex's ZeRO-sharded LAMB on ``torch.distributed`` (NCCL on GPUs, Gloo on CPUs).

Each rank keeps the fp32 master weights and the two moments of ``1 / world`` of the parameters (its shard,
see ``_dist_lamb_layout``). One step::

    backward      gradient of each parameter copied (÷ world) into a flat buffer by a backward hook; a
                  block's reduce-scatter starts as soon as all its gradients are in (overlap_reductions)
    ‖g‖           global norm of the averaged, still loss-scaled gradients: all-reduce of the shards'
                  squared norms (L2_grad_norm)
    skip          if ‖g‖ is not finite: nothing changes, has_overflow is True, the step count stays
    ĝ             shard / (global_scale * clip),  clip = max(1, ‖g‖ / global_scale / max_grad_norm)
                  (no clipping when max_grad_norm == 0)
    u             FusedLAMB's update direction on the shard's fragments: m, v, bias corrections, eps,
                  decoupled or L2 weight decay (apex.ops.multi_tensor_adam with grad averaging, which is
                  Adam's moment update; apex.ops.multi_tensor_lamb without)
    trust ratio   ‖p‖ and ‖u‖ of every *whole* parameter: one all-reduce of the fragments' squared norms,
                  then p -= lr * ‖p‖/‖u‖ * u (apex.ops.multi_tensor_lamb_stage2_cuda)
    all-gather    the updated shards, written back to the model's parameters

so the parameters after a step are ``apex.optimizers.FusedLAMB``'s on the gradients averaged over ranks.
With ``clip_after_ar=False`` (upstream's option) every rank instead clips its own gradient by its own norm
before the reduction and ``L2_grad_norm`` is that local norm. Dtype policy: fp32 masters and moments;
gradients are reduced and parameters gathered in the parameters' dtype (fp32 when the model mixes dtypes).
"""

from __future__ import annotations

import math
import weakref
from collections import deque
from itertools import repeat
from operator import attrgetter, eq, is_

import torch
import torch.distributed as dist

from apex import _backend
from apex._kernels._lists import column
from apex.contrib.optimizers import _dist_lamb_checkpoint
from apex.contrib.optimizers._dist_lamb_layout import Layout, shard_groups  # noqa: F401
from apex.contrib.optimizers._dist_lamb_setup import _DTYPES, _Setup  # noqa: F401
from apex.contrib.optimizers._dist_lamb_step import _CHUNK, _Step
from apex.contrib.optimizers._gloo_collectives import all_gather_into_tensor as _all_gather
from apex.contrib.optimizers._gloo_collectives import all_reduce as _all_reduce
from apex.contrib.optimizers._gloo_collectives import reduce_scatter_tensor as _reduce_scatter
from apex.contrib.optimizers._gloo_collectives import takes_gloo_path  # noqa: F401
from apex.ops._cpu_blocks import Workspace  # noqa: F401
from apex.ops.multi_tensor_adam import multi_tensor_adam  # noqa: F401
from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm  # noqa: F401
from apex.ops.multi_tensor_lamb import multi_tensor_lamb, multi_tensor_lamb_stage2_cuda  # noqa: F401
from apex.ops.multi_tensor_scale import multi_tensor_scale
from apex.optimizers._base import _number, check_betas, check_non_negative, fused_step  # noqa: F401

# The set-up (_dist_lamb_setup) and the step's math (_dist_lamb_step) are base classes in their own modules;
# the names they use (marked F401 above) are importable from here too, where callers look for them.
_dtype = attrgetter("dtype")
_contiguous = torch.Tensor.is_contiguous


class DistributedFusedLAMB(_Setup, _Step, torch.optim.Optimizer):
    """LAMB with ZeRO sharding of the optimizer state (see the module docstring for the math).

    Arguments as upstream's: ``lr`` (1e-3), ``bias_correction`` (True), ``grad_averaging`` (True: ``1 - beta1``
    on the gradient in the first moment), ``betas`` ((0.9, 0.999)), ``eps`` (1e-8), ``weight_decay`` (0),
    ``max_grad_norm`` (0: no clipping), ``adam_w_mode`` (True: decoupled decay; False: L2), ``use_nvlamb``
    (False: trust ratio only where weight_decay != 0), ``step_supports_amp_scaling`` (True: ``GradScaler.step``
    hands itself to ``step``), ``overlap_reductions`` (True: reduce-scatter blocks from backward hooks),
    ``clip_after_ar`` (True: clip the averaged gradient; False: each rank clips its own before reducing),
    ``skip_allgather`` (False; True leaves the model's parameters stale), ``verbose`` (print the layout).

    The ``dwu_*`` knobs: ``dwu_group_size`` (0: the world) shards over groups of that many consecutive
    ranks, the shards being all-reduced across groups (upstream's intra-node reduce-scatter + inter-node
    all-reduce); ``dwu_num_blocks`` (4) is the number of blocks reduced independently during backward;
    ``dwu_num_chunks`` (4) the number of reduce-scatters per block. ``dwu_num_rs_pg``, ``dwu_num_ar_pg``,
    ``dwu_num_ag_pg`` (upstream: extra process groups for parallel CUDA streams), ``fused_norm``,
    ``fuse_scale``, ``e5m2_allgather`` (parameters are gathered in their own dtype), ``full_ar`` (gradients
    are always reduce-scattered), ``set_param_views_to_flat_buffer``, ``param_order`` and
    ``nccl_allgather_channels`` are accepted and have no effect on the result or on the collectives.

    Differences from upstream: everything is set up in the constructor (it broadcasts the parameters from
    rank 0, a collective); ``_lazy_init_stage1/2`` are no-ops; ``step`` completes the reductions itself if
    ``complete_reductions`` was not called; the learning rate is each group's ``lr`` unless ``_lr`` is set
    (upstream reads only ``_lr``); clipping divides by ``max(1, ‖g‖ / max_grad_norm)`` like ``FusedLAMB``
    (upstream adds 1e-6 to the norm); ``grad_averaging=False`` is honoured.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, grad_averaging=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.0, max_grad_norm=0.0, adam_w_mode=True, use_nvlamb=False,
                 step_supports_amp_scaling=True, overlap_reductions=True, dwu_group_size=0, dwu_num_blocks=4,
                 dwu_num_chunks=4, dwu_num_rs_pg=1, dwu_num_ar_pg=4, dwu_num_ag_pg=0, fused_norm=False,
                 e5m2_allgather=False, verbose=False, clip_after_ar=True, full_ar=False,
                 set_param_views_to_flat_buffer=False, skip_allgather=False, fuse_scale=False, param_order=None,
                 nccl_allgather_channels=0):
        for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                            ("max_grad_norm", max_grad_norm)):
            check_non_negative(value, name)
        check_betas(betas)
        for name, value in (("dwu_num_blocks", dwu_num_blocks), ("dwu_num_chunks", dwu_num_chunks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedFusedLAMB needs torch.distributed to be initialized "
                               "(torch.distributed.init_process_group)")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, grad_averaging=grad_averaging, max_grad_norm=max_grad_norm)
        super().__init__(params, defaults)
        self._adam_w_mode = 1 if adam_w_mode else 0
        self._use_nvlamb = bool(use_nvlamb)
        self._step_supports_amp_scaling = bool(step_supports_amp_scaling)
        self._overlap_reductions = bool(overlap_reductions)
        self._clip_after_ar = bool(clip_after_ar)
        self._skip_ag = bool(skip_allgather)
        self._verbose = bool(verbose)
        self._num_blocks, self._num_chunks = dwu_num_blocks, dwu_num_chunks
        # accepted for upstream's signature; see the class docstring
        self._num_rs_pg, self._num_ar_pg, self._num_ag_pg = dwu_num_rs_pg, dwu_num_ar_pg, dwu_num_ag_pg
        self._fused_norm, self._fuse_scale, self._e5m2_allgather = fused_norm, fuse_scale, e5m2_allgather
        self._full_ar, self._set_flat_param_view = full_ar, set_param_views_to_flat_buffer
        self._is_accumulation_step = False
        self._last_step = False
        self._global_scale = None
        self._lr = None
        self._L2_grad_norm = None
        self._has_overflow = False
        self._step = 0
        self._setup_groups(dwu_group_size)
        self._setup_params()
        self._reset_step_state()

    # -- backward hooks -----------------------------------------------------------------------------------
    def _make_hook(self, i: int):
        ref = weakref.ref(self)  # the hooks outlive the optimizer: they must not keep it alive

        def hook(param: torch.Tensor) -> None:
            opt = ref()
            if opt is not None:
                opt._on_grad_ready(i)
        return hook

    def _on_grad_ready(self, i: int) -> None:
        if self._is_accumulation_step or not (self._overlap_reductions and self._clip_after_ar):
            return
        blocks = self._layout.param_blocks[i]
        if self._taken[i]:
            self._flush_grads()
            if any(self._launched[b] for b in blocks):
                raise RuntimeError("DistributedFusedLAMB: a second backward in the same step after its gradients "
                                   "were sent; call set_is_accumulation_step(True) for all but the last backward")
            self._take_grad(i, 1.0 / self._world_size)
            return
        if not (self._queueable[i] and self._queue_grad(i)):
            self._take_grad(i, 1.0 / self._world_size)
        self._taken[i] = True
        for b in blocks:
            self._block_pending[b] -= 1
            if self._block_pending[b] == 0:
                self._launch_block(b)

    def _queue_grad(self, i: int) -> bool:
        """Queue parameter ``i``'s gradient for :meth:`_flush_grads` (False outside a backward, where nothing
        would flush it). A hook runs once per parameter per backward, in Python: a copy each cost more than the
        rest of the hook for small parameters, so the queue is copied in one multi-tensor op when a block is
        complete, the backward ends or the reduction is finished. As upstream's hook, it queues the gradient
        tensor the parameter holds now."""
        if not self._flush_registered:
            try:
                torch.autograd.Variable._execution_engine.queue_callback(self._flush_grads)
            except RuntimeError:
                return False
            self._flush_registered = True
        self._queued.append(i)
        self._queued_grads.append(self._model_params[i].grad)
        return True

    def _flush_grads(self) -> None:
        """Copy the queued gradients, divided by the world size, into the flat buffer: on the Triton path with
        apex's multi-tensor scale (one launch, as upstream flattens them), else foreach copies; a None
        gradient leaves zeros, one not contiguous or of another dtype is copied alone. (No grad mode
        needed: neither the gradients nor the buffer require grad.)"""
        self._flush_registered = False
        queued = self._queued
        if not queued:
            return
        grads = self._queued_grads
        self._queued, self._queued_grads = [], []
        views = list(map(self._grad_views.__getitem__, queued))
        scale = 1.0 / self._world_size
        dtype = self._flat_dtype
        if (any(map(is_, grads, repeat(None))) or not all(map(_contiguous, grads))
                or not all(map(is_, map(_dtype, grads), repeat(dtype)))):
            with torch.no_grad():
                for g, view in zip(grads, views):
                    if g is None:
                        view.zero_()
                    else:
                        torch.mul(g, scale, out=view)
            return
        if _backend.select_tensor(views[0]) == "triton":
            # x * scale in fp32 rounded once to the buffer's dtype: torch.mul's result for one dtype
            multi_tensor_scale(_CHUNK, self._copy_flag, [column(grads, dtype=dtype, device=self._device),
                                                         column(views, dtype=dtype, device=self._device)], scale)
            return
        torch._foreach_copy_(views, grads)
        if scale != 1.0:
            torch._foreach_mul_(views, scale)

    def _reset_step_state(self) -> None:
        self._queued: list = []  # parameters whose gradients the hooks queued for _flush_grads
        self._queued_grads: list = []  # and those gradients
        self._flush_registered = False
        self._taken = [False] * len(self._model_params)
        self._block_pending = list(self._layout.block_params)
        self._launched = [False] * self._num_blocks
        self._works = []
        self._reduced = False

    # -- gradient reduction ----------------------------------------------------------------------------------
    def _take_grad(self, i: int, scale: float) -> None:
        # Hooks run once per parameter inside backward, where grad mode is already off (unless create_graph):
        # a no_grad decorator here cost more than the copy for small parameters.
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._take_grad(i, scale)
        g = self._model_params[i].grad
        if g is None:
            self._grad_views[i].zero_()
        else:
            torch.mul(g, scale, out=self._grad_views[i])
        self._taken[i] = True

    def _launch_block(self, b: int) -> None:
        if self._launched[b]:
            return
        self._flush_grads()
        self._launched[b] = True
        lay = self._layout
        for k in lay.block_pieces(b):
            lo, hi = lay.piece_range(k)
            out = self._fp16_g[k * lay.piece:(k + 1) * lay.piece]
            scratch = None if self._rs_scratch is None else self._rs_scratch[lo:hi]
            self._works.append(_reduce_scatter(out, self._flat_grads[lo:hi], group=self._rs_pg, async_op=True,
                                               scratch=scratch))

    @torch.no_grad()
    def complete_reductions(self) -> None:
        """Finish the gradient reduction of this step: gradients no hook took (all of them without
        ``overlap_reductions``; missing ones count as zero) are flattened, the remaining blocks reduced, and
        ``L2_grad_norm`` computed. A no-op on accumulation steps and when already done this step."""
        if self._is_accumulation_step or self._reduced:
            return
        self._flush_grads()
        if self._clip_after_ar:
            if not all(self._taken):  # (after a backward whose hooks took every gradient: one C-level pass)
                for i, taken in enumerate(self._taken):
                    if not taken:
                        self._take_grad(i, 1.0 / self._world_size)
        else:
            # upstream's clip before the reduction: each rank clips its own gradient by its own norm
            for i in range(len(self._taken)):
                self._take_grad(i, 1.0)
            local = torch.linalg.vector_norm(self._flat_grads, dtype=torch.float32).reshape(1)
            self._L2_grad_norm = local
            coeff = 1.0
            max_norm = self.defaults["max_grad_norm"]
            scale = self._scale_value()
            norm = float(local) / scale
            if max_norm > 0 and math.isfinite(norm) and norm > max_norm:
                coeff = max_norm / norm
            self._flat_grads.mul_(coeff / self._world_size)
        for b in range(self._num_blocks):
            self._launch_block(b)
        for w in self._works:
            w.wait()
        self._works = []
        if self._ar_pg is not None:
            dist.all_reduce(self._fp16_g, group=self._ar_pg)
        if self._clip_after_ar:
            sq = torch.linalg.vector_norm(self._fp16_g, dtype=torch.float32).square().reshape(1)
            _all_reduce(sq, group=self._rs_pg)
            self._L2_grad_norm = sq.sqrt()
        self._reduced = True

    # -- the all-gather ---------------------------------------------------------------------------------------
    def _gather_params(self) -> None:
        if self._skip_ag:
            return
        lay = self._layout
        if self._fp16_p.dtype == self._fp32_p.dtype:
            shard = self._fp32_p  # fp32 parameters: the master shard is what every rank receives
        else:
            shard = self._fp16_p
            shard.copy_(self._fp32_p)
        _all_gather(self._new_params, shard, group=self._rs_pg)
        params = self._model_params
        # Read from the parameters themselves, one C-level pass per fact: a ``p.data`` per parameter made a
        # tensor object each, most of this method's cost for many small parameters.
        if all(map(torch.Tensor.is_contiguous, params)):
            # gathered: [rank][piece][slice]; each segment is contiguous there and in its parameter. The
            # views are built again only when a parameter's storage changed.
            # (addresses compared as they are read: building a tuple of them from a map of unknown length
            # cost more in reallocations than the reads)
            if self._segment_views is None or not all(map(eq, map(torch.Tensor.data_ptr, params),
                                                          self._segment_views[0])):
                key = [p.data_ptr() for p in params]
                flat = [p.detach().view(-1) for p in params]
                segs = self._gather_segments
                # Columns (addresses read once; the views hold their storage): the Triton path's copy keeps
                # its device table while the parameters stay where they are
                self._segment_views = (key, column([flat[i][o:o + n] for i, o, _, n in segs]),
                                       column([self._new_params[g:g + n] for _, _, g, n in segs]))
            _, outs, ins = self._segment_views
            if outs and _backend.select_tensor(self._new_params) == "triton":
                # Apex's copy (multi_tensor_scale by 1.0): one launch per dtype pair, bit for bit copy_'s cast
                multi_tensor_scale(_CHUNK, self._copy_flag, [ins, outs], 1.0)
            else:
                torch._foreach_copy_(outs, ins)
            return
        # flat order: [piece][rank][slice]
        flat = self._new_params.view(lay.world, lay.pieces, lay.piece).transpose(0, 1).reshape(-1)
        torch._foreach_copy_([p.detach() for p in params],
                             [flat[o:o + p.numel()].view(p.shape) for o, p in zip(lay.offsets, params)])

    # -- upstream's small public API --------------------------------------------------------------------------
    def set_global_scale(self, global_scale) -> None:
        """The loss scale the gradients carry (a number or a one-element tensor); ``None``: 1."""
        self._global_scale = global_scale

    @property
    def global_scale(self):
        return self._global_scale

    @property
    def L2_grad_norm(self) -> torch.Tensor | None:
        """Norm of this step's reduced (still loss-scaled) gradients; with ``clip_after_ar=False`` this
        rank's own gradient norm."""
        return self._L2_grad_norm

    @property
    def has_overflow(self) -> bool:
        """Whether the last ``step`` found a non-finite gradient norm and skipped."""
        return self._has_overflow

    def set_is_accumulation_step(self, is_accumulation_step: bool) -> None:
        """While True, backward hooks leave the gradients in ``.grad`` (accumulating there)."""
        self._is_accumulation_step = bool(is_accumulation_step)

    def set_last_step(self, last_step: bool) -> None:
        """Upstream zeroes the gradients that no hook took on the last step; here that is always done."""
        self._last_step = bool(last_step)

    def _lazy_init_stage1(self) -> None:
        """Upstream's deferred set-up; done in the constructor here."""

    def _lazy_init_stage2(self) -> None:
        """Upstream's deferred set-up; done in the constructor here."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. The hooks leave each gradient on its parameter (as
        upstream's do), so every iteration drops them all here: with ``set_to_none`` in one C-level pass per
        group (torch's loop costs a Python iteration per parameter, more than freeing the gradient)."""
        if not set_to_none:
            super().zero_grad(set_to_none=False)
            return
        for group in self.param_groups:
            deque(map(setattr, group["params"], repeat("grad"), repeat(None)), maxlen=0)

    # -- checkpoints ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's shard, as upstream (``step``, ``fp32_p``, ``fp32_m``, ``fp32_v``; copies), plus the
        layout it belongs to and the groups' hyper-parameters."""
        return _dist_lamb_checkpoint.shard_state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of the same rank in the same layout (same world size, ``dwu_group_size``,
        ``dwu_num_blocks``/``dwu_num_chunks`` and parameters); the model's parameters are loaded separately.
        A mismatch raises ``ValueError`` and changes nothing."""
        _dist_lamb_checkpoint.load_shard_state_dict(self, state_dict)
