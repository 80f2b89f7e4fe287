"""The optimizer step of ``DistributedFusedAdam``: Adam on this rank's shards of every bucket, then the
parameter all-gather (``_zero_comm``) that writes the updated values back into the model."""

from __future__ import annotations

import weakref

import torch

from apex._kernels._lists import column
from apex.contrib.optimizers import _zero_buckets as zb
from apex.contrib.optimizers._zero_comm import ZeroCommMixin
from apex.optimizers._base import fused_step


def _where(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.data_ptr(), t.dtype, t.numel())


class ZeroStepMixin:
    # fused_step: torch.optim's wrapper (step hooks, the profiler's range) only while a hook or a profiler
    # is there to see it; entering the range alone cost about as much as a 100-parameter step's Python
    @fused_step
    def step(self, closure=None, *, grad_scaler=None):
        """One Adam step on this rank's shard, then the parameter all-gather. With a ``GradScaler`` whose
        gradients hold an inf/NaN the step is skipped and nothing changes."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.init_params()
        # The parameter list init_params has just checked (the tuple it keeps): the step's passes over the
        # parameters (grad_sync, the parameter copy) read it instead of checking the list again. Only for
        # this call: between steps the list may change.
        self._step_params = self._all_placed[0]
        try:
            return self._step_placed(loss, grad_scaler)
        finally:
            self._step_params = None

    def _step_placed(self, loss, grad_scaler):
        from torch.amp.grad_scaler import OptState

        self.param_sync()
        self.grad_sync()
        if grad_scaler is not None and grad_scaler._enabled:
            st = grad_scaler._per_optimizer_states[id(self)]
            if st["stage"] is OptState.READY:
                self.unscale_grads(grad_scaler=grad_scaler)
            found_inf = st["found_inf_per_device"][self.device]
            if self.capturable:
                self._dummy_overflow_buf.copy_(found_inf.reshape([1]))
            elif found_inf.item():
                return loss
        with self._lock, torch.no_grad():
            self._prepare_param_buckets()
            if self.capturable:
                self.state["step"] += (self._dummy_overflow_buf != 1).to(torch.int32)
            else:
                self.state["step"] += 1
            self._local_step(list(range(len(self.state["buckets"]))))
            # With overlap_param_sync the next forward needs the last bucket first (buckets are in gradient
            # order); otherwise they go in bucket order, largest first: posted after a small last bucket, a
            # full one finished later (2 Gloo ranks, MLP 4x512: steps 3-4 % longer).
            pending = self._params_buckets
            self._start_bucket_param_sync(list(pending.values()) if self.overlap_param_sync
                                          else [pending[i] for i in sorted(pending)])
            if not self.overlap_param_sync:
                self._write_own_params()
        if self.overlap_param_sync and self.distributed_size > 1:
            self._arm_pre_forward_hooks()
        else:
            self.param_sync()
        return loss

    def _prepare_param_buckets(self) -> None:
        for bucket_id in reversed(range(len(self.state["buckets"]))):
            sb = self.state["buckets"][bucket_id]
            pb = self._params_buckets[bucket_id] = self.ParameterBucket()
            if self.contiguous_param_buffer:
                if not self._param_buffers:
                    self.init_param_buffer()
                start = sb.contiguous_buffer_offset
                pb.params_bucket = self._param_buffers[sb.dtypes()][start:start + sb.bucket_size]
                r = self.distributed_rank * sb.shard_size
                pb.params_shard = pb.params_bucket[r:r + sb.shard_size]
            elif sb.param_sync_dtype.is_floating_point:
                # Adam writes this rank's part of the bucket: the all-gather then copies nothing locally. On
                # one rank too: a buffer kept across steps keeps the parameter copy's plan (_param_copy_part,
                # keyed by the buffers' addresses) valid, where a new shard every step rebuilt its views.
                pb.params_bucket = self._comm_buffer("params", bucket_id, sb.bucket_size, sb.param_sync_dtype)
                r = self.distributed_rank * sb.shard_size
                pb.params_shard = pb.params_bucket[r:r + sb.shard_size]
                self._alias_master_shard(sb, pb.params_shard)
            if not sb.param_sync_dtype.is_floating_point:  # Adam writes floats; cast in _check_params_shard_dtypes
                pb.params_shard = torch.empty([sb.shard_size], dtype=sb.dtype, device=self.device)
            elif pb.params_shard is None:
                pb.params_shard = torch.empty([sb.shard_size], dtype=sb.param_sync_dtype, device=self.device)

    def _write_own_params(self) -> None:
        """While the all-gathers run, write this rank's own updated shard into the parameters; param_sync then
        copies only the other ranks' parts (measured on 2 CPU ranks, 1M parameters: 0.2-0.25 ms less per step
        than the whole copy after the wait). Only where the own shard is the all-gather's input inside the
        gathered buffer (it is final before the collective starts) and the copy is this class's own."""
        if (self.distributed_size == 1 or self.contiguous_param_buffer
                or type(self)._param_copy_fragments is not ZeroCommMixin._param_copy_fragments):
            return
        parts = {}
        for bucket_id, pb in self._params_buckets.items():
            sb = self.state["buckets"][bucket_id]
            if pb.status is not zb.ParameterStatus.SYNCING or pb.params_shard is None or pb.params_bucket is None:
                continue
            own = pb.params_bucket[self.distributed_rank * sb.shard_size:]
            if pb.params_shard.dtype != own.dtype or pb.params_shard.data_ptr() != own.data_ptr():
                continue
            pb.own_written = True
            parts[bucket_id] = "own"  # (a fragment outside the local shard has no own part: nothing copied)
        if parts:
            self._param_copy_buckets(parts)

    def _alias_master_shard(self, sb: zb.StateBucket, own: torch.Tensor) -> None:
        """Keep the fp32 master shard in this rank's part of the reused all-gather buffer when the two have
        one dtype: Adam then updates the values the all-gather sends in place, instead of writing the master
        and copying it into the buffer (a read and a write of the shard per step, and a shard less memory).
        The all-gather writes only the other ranks' parts, so the master survives it. Anything that replaced
        the buffer or the master (a checkpoint load, a new buffer) is caught here: the values move once."""
        if (sb.params_shard is None or sb.param_remainders_shard is not None or self.with_scaled_states
                or sb.params_shard.dtype != own.dtype or sb.params_shard.data_ptr() == own.data_ptr()):
            return
        own.copy_(sb.params_shard)
        sb.params_shard = own

    def _local_step(self, bucket_ids) -> None:
        """Adam on the local shards, grouped by parameter group, through ``distributed_adam_cuda``'s kernels."""
        if self.with_scaled_states:
            self._local_step_with_scaled_states(bucket_ids)
            return
        for (group_id, rem), lists in self._local_lists(bucket_ids).items():
            group = self.param_groups[group_id]
            beta1, beta2 = group["betas"]
            args = (self._grad_scale, group["lr"], beta1, beta2, group["eps"], self.state["step"],
                    int(self.adam_w_mode), int(bool(group["bias_correction"])), group["weight_decay"])
            if rem:
                zb.multi_tensor_fused_adam_with_param_remainders(2048 * 32, self._dummy_overflow_buf, lists, *args)
            elif self.capturable:
                zb.multi_tensor_fused_adam_capturable(2048 * 32, self._dummy_overflow_buf, lists, *args)
            else:
                zb.multi_tensor_fused_adam(2048 * 32, self._dummy_overflow_buf, lists, *args)
        self._check_params_shard_dtypes({i: self._params_buckets[i] for i in bucket_ids})

    def _local_lists(self, bucket_ids) -> dict:
        """``{(param_group_id, remainders): the tensor lists of its Adam launch}``. With master shards the
        lists are views of buffers that live from step to step, so they are kept, as Columns (the
        multi-tensor engine reads their addresses once), while each bucket, its runs and the address, dtype
        and size of every tensor they view are the same: a step then makes no views (one step's fixed cost)."""
        buckets = self.state["buckets"]
        key = []
        for i in bucket_ids:
            sb = buckets[i]
            if sb.params_shard is None:  # the shard is read from the model: new tensors every step
                return self._build_local_lists(bucket_ids, keep=False)
            key.append((i, sb, self._local_runs(sb), *map(_where, (
                self._grads_buckets[i].grads_shard, self._params_buckets[i].params_shard, sb.params_shard,
                sb.param_remainders_shard, sb.exp_avg_shard, sb.exp_avg_sq_shard))))
        key = tuple(key)
        held = self.__dict__.get("_local_lists_cache")
        if held is None or held[0] != key:
            # (the kept views hold their buffers, so an address in the key cannot be reused by another one)
            held = self._local_lists_cache = (key, self._build_local_lists(bucket_ids, keep=True))
        return held[1]

    def _build_local_lists(self, bucket_ids, keep: bool) -> dict:
        groups: dict = {}
        for bucket_id in bucket_ids:
            sb = self.state["buckets"][bucket_id]
            grads = self._grads_buckets[bucket_id].grads_shard
            out = self._params_buckets[bucket_id].params_shard
            rem = sb.param_remainders_shard is not None
            for group_id, r, frag in self._local_runs(sb):
                if sb.params_shard is not None:
                    p_in = sb.params_shard[r]
                else:
                    model = zb._flat(self.parameter(frag))[slice(*frag.shard_param_range)]
                    p_in = model.to(torch.bfloat16 if rem else sb.dtype, copy=True)
                key = (group_id, rem)
                lists = groups.setdefault(key, [[] for _ in range(6 if rem else 5)])
                row = ([p_in, sb.param_remainders_shard[r]] if rem else [p_in]) + [
                    sb.exp_avg_shard[r], sb.exp_avg_sq_shard[r], grads[r], out[r]]
                for lst, t in zip(lists, row):
                    lst.append(t)
        if keep:
            groups = {k: [column(lst) for lst in lists] for k, lists in groups.items()}
        return groups

    def _local_runs(self, sb: zb.StateBucket) -> list:
        """``(param_group_id, shard slice, fragment)`` for the local fragments of a bucket. With fp32 master
        shards, neighbouring fragments of one parameter group merge into one slice (fragment None): Adam is
        elementwise and the alignment padding between them is zero in every state, gradient and parameter,
        so it stays zero, and a model of many small parameters then costs a few tensors per step. Kept per
        bucket (sorting the fragments costs a microsecond per parameter every step) while its fragments and
        kind of shards are the same."""
        cache = self.__dict__.setdefault("_local_runs_cache", {})
        key = (len(sb.fragments), sb.params_shard is None, sb.param_remainders_shard is None)
        held = cache.get(id(sb))
        if held is not None and held[0]() is sb and held[1] == key:
            return held[2]
        runs = self._plan_local_runs(sb)
        cache[id(sb)] = (weakref.ref(sb), key, runs)  # (a bucket replaced by a checkpoint load is not kept)
        return runs

    @staticmethod
    def _plan_local_runs(sb: zb.StateBucket) -> list:
        frags = sorted((f for f in sb.fragments if f.in_local_shard and f.shard_range[1] > f.shard_range[0]),
                       key=lambda f: f.shard_range[0])
        if sb.params_shard is None or sb.param_remainders_shard is not None:
            return [(f.param_group_id, slice(*f.shard_range), f) for f in frags]
        runs: list = []
        for f in frags:
            if runs and runs[-1][0] == f.param_group_id:
                runs[-1][2] = f.shard_range[1]
            else:
                runs.append([f.param_group_id, f.shard_range[0], f.shard_range[1]])
        return [(g, slice(a, b), None) for g, a, b in runs]

    @zb.no_grad
    def _check_params_shard_dtypes(self, params_buckets: dict) -> None:
        """Cast each updated local shard to its bucket's ``param_sync_dtype`` (an integer dtype receives the
        most significant bytes of the float values, as in Apex)."""
        for bucket_id, pb in params_buckets.items():
            dtype = self.state["buckets"][bucket_id].param_sync_dtype
            if pb.params_shard.dtype != dtype:
                out = torch.empty_like(pb.params_shard, dtype=dtype)
                zb._copy_cast(pb.params_shard, out)
                pb.params_shard = out
