"""Gradient reduce-scatter and parameter all-gather of ``DistributedFusedAdam`` (its step: ``_zero_step``).

Collectives are asynchronous ``torch.distributed`` works (on Gloo through ``_gloo_collectives``, NCCL on GPUs);
a bucket's work is waited for when its result is first needed. Every rank issues the same collectives in
the same order because buckets become full in the same (backward) order on every rank. The parameter side
(all-gather, pre-forward hooks) is ``_zero_param_sync``.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch
import torch.distributed as dist

from apex.contrib.optimizers import _zero_buckets as zb
from apex.contrib.optimizers._gloo_collectives import reduce_scatter_tensor as _reduce_scatter
from apex.contrib.optimizers._gloo_collectives import takes_gloo_path
from apex.contrib.optimizers._zero_param_sync import (  # noqa: F401  (this module's former names)
    _PENDING_CLASSES,
    ZeroParamSyncMixin,
    _all_gather,
    _fragments,
    _pending_args,
    _pending_class,
    _ptr,
)

_grad = operator.attrgetter("grad")


class ZeroCommMixin(ZeroParamSyncMixin):
    def _comm_buffer(self, purpose: str, bucket_id: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer kept for one bucket and purpose across steps. The bucket buffers live from backward to
        step (gradients) or from step to the next forward (parameters), never two generations at once, and
        allocating them afresh every step costs page faults on the CPU (measured: ~550 per step at 1M
        parameters) and allocator traffic on GPUs."""
        buf = self._comm_buffers.get((purpose, bucket_id))
        if buf is None or buf.numel() != numel or buf.dtype != dtype:
            buf = self._comm_buffers[(purpose, bucket_id)] = torch.empty([numel], dtype=dtype, device=self.device)
        return buf

    # -- gradients -----------------------------------------------------------------------------------------

    def _grads_bucket_for(self, bucket_id: int, gb) -> torch.Tensor:
        """Hand out the bucket's gradient buffer. The reused communication buffer is not zeroed: only the
        gaps between fragments are, and each fragment's first gradient is copied in rather than added
        (``gb.written``), which saves a write and a read of the whole bucket per step; fragments that got no
        gradient are zeroed before the reduction (``_zero_unwritten``)."""
        sb = self.state["buckets"][bucket_id]
        if self.contiguous_grad_buffer:
            if not self._grad_buffers:
                self._init_grad_buffer()
            start = sb.contiguous_buffer_offset
            gb.grads_bucket = self._grad_buffers[sb.dtypes()][start:start + sb.bucket_size]
            gb.grads_bucket.zero_()
            gb.written = None
            return gb.grads_bucket
        lent = self._comm_buffers.get(("grads", bucket_id))
        if (lent is not None and gb.grads_shard is not None
                and gb.grads_shard.untyped_storage().data_ptr() == lent.untyped_storage().data_ptr()):
            # An earlier backward's reduced shard still lives in the buffer (no zero_grad since): the
            # buffer stays with it and this backward gets a new one.
            del self._comm_buffers[("grads", bucket_id)]
        buf = gb.grads_bucket = self._comm_buffer("grads", bucket_id, sb.bucket_size, sb.grad_sync_dtype)
        gaps, index, _ = self._bucket_gaps(sb)
        for a, b in gaps:
            buf[a:b].zero_()
        if index is not None:  # many small parameters: one op for all the alignment gaps between them
            buf.index_fill_(0, index, 0)
        gb.written = set()
        return buf

    def _bucket_gaps(self, sb) -> tuple:
        """``(gaps, index, written_keys)`` of a bucket: the ranges no fragment covers (alignment padding and
        the tail), as ``(start, end)`` pairs; with more than a few gaps between fragments, those as one index
        tensor of their elements instead, the tail still a range (zeroing a gap costs an op, one per
        parameter for a model of small parameters); and
        the number of fragment keys that a bucket written whole holds. Kept while the bucket and its
        fragments are the same (fragments are only appended, or the bucket replaced)."""
        cache = self.__dict__.setdefault("_bucket_gaps_cache", {})
        held = cache.get(id(sb))
        if held is not None and held[0] is sb and held[1] == len(sb.fragments):
            return held[2]
        spans = [f.bucket_range for f in sb.fragments if f.bucket_range[1] > f.bucket_range[0]]
        gaps, end = [], 0
        for a, b in sorted(spans):
            if a > end:
                gaps.append((end, a))
            end = max(end, b)
        tail = (end, sb.bucket_size)
        index = None
        if len(gaps) > 4:
            index = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in gaps]).to(self.device)
            gaps = [tail] if tail[1] > tail[0] else []
        elif tail[1] > tail[0]:
            gaps.append(tail)
        keys = len({(f.param_group_id, f.param_id) for f in sb.fragments if f.bucket_range[1] > f.bucket_range[0]})
        if len(cache) > 4 * len(self.state["buckets"]) + 4:
            cache.clear()  # entries of replaced buckets
        cache[id(sb)] = (sb, len(sb.fragments), (gaps, index, keys))
        return gaps, index, keys

    def _zero_unwritten(self, bucket_id: int, gb) -> None:
        """Zero the regions of fragments that received no gradient in this bucket (see _grads_bucket_for)."""
        if gb.written is None:
            return
        sb = self.state["buckets"][bucket_id]
        if len(gb.written) == self._bucket_gaps(sb)[2]:  # (the usual case: every fragment got its gradient)
            gb.written = None
            return
        for f in sb.fragments:
            if f.bucket_range[1] > f.bucket_range[0] and (f.param_group_id, f.param_id) not in gb.written:
                gb.grads_bucket[slice(*f.bucket_range)].zero_()
        gb.written = None

    def _grad_copy(self, param: torch.nn.Parameter) -> None:
        """Add ``param.grad`` into its buckets and drop it."""
        if self._has_deferred:
            self._flush_deferred_grads()
        state = self.state[param]
        if "fragments" not in state:
            self.init_params([param])
        grad = param.grad
        views = self._grad_views
        flat = None
        for frag in state["fragments"]:
            gb = self._grads_buckets[frag.bucket_id]
            if gb.status is zb.GradientStatus.SYNCING:
                self._finish_bucket_grad_sync()
            gb.status = zb.GradientStatus.PARTIALLY_FILLED
            buf = gb.grads_bucket
            if buf is None:
                buf = self._grads_bucket_for(frag.bucket_id, gb)
            if grad is None:
                continue
            # The hook runs once per parameter per backward, in Python: what a fragment needs (its key, its
            # view of the reused bucket buffer, shaped like the gradient when it covers the whole
            # parameter) is kept from step to step, so a whole contiguous gradient builds no tensors.
            cached = views.get(id(frag))
            if cached is None or cached[0] is not frag or cached[1] is not buf:
                b0, b1 = frag.bucket_range
                if b1 <= b0:
                    continue
                whole = frag.param_range == (0, grad.numel())
                dst = buf[b0:b1].view(grad.shape) if whole and grad.is_contiguous() else buf[b0:b1]
                cached = views[id(frag)] = (frag, buf, dst, (frag.param_group_id, frag.param_id), whole)
            dst = cached[2]
            if cached[4] and grad.is_contiguous() and dst.shape == grad.shape:
                src = grad
            else:
                flat = zb._flat(grad) if flat is None else flat
                src, dst = flat[slice(*frag.param_range)], buf[slice(*frag.bucket_range)]
            written = gb.written
            if written is not None and cached[3] not in written:
                written.add(cached[3])
                dst.copy_(src)
            elif src.data_ptr() != dst.data_ptr():
                dst.add_(src)
        param.grad = None

    def _try_start_bucket_grad_sync(self, params=None, ignore_last_bucket: bool = False) -> None:
        """Start reducing every bucket all of whose parameters have produced a gradient."""
        buckets = self.state["buckets"]
        for p in params or []:
            for frag in self.state[p]["fragments"]:
                self._grads_buckets[frag.bucket_id].note_generated((frag.param_group_id, frag.param_id),
                                                                   len(buckets[frag.bucket_id].fragments))
        for gb in self._grads_buckets.values():
            if gb.status is zb.GradientStatus.FULLY_FILLED:
                break
        else:
            return
        last = len(buckets) - 1
        full = [gb for i, gb in sorted(self._grads_buckets.items())
                if gb.status == zb.GradientStatus.FULLY_FILLED and not (ignore_last_bucket and i == last)]
        if full:
            self._start_bucket_grad_sync(full)

    def _start_bucket_grad_sync(self, buckets) -> None:
        """Reduce-scatter (then all-reduce over the redundant group) the buckets, asynchronously."""
        if not self._buckets_shrunk:
            # Parameters placed before backward (init_params, contiguous buffers) start the last bucket's
            # reduction inside backward, before grad_sync would have cut it to its contents.
            self._shrink_last_buckets()
        op = dist.ReduceOp.SUM
        average = self.average_grad_sync
        group = self.distributed_process_group
        if average and (dist.get_backend(group) == "nccl"
                        or takes_gloo_path(group, dist.ReduceOp.AVG) and self.redundant_size == 1):
            # NCCL averages in its kernel, Gloo's reduce-scatter (_gloo_collectives) divides only the shard.
            op, average = dist.ReduceOp.AVG, False
        bucket_ids = {id(gb): i for i, gb in self._grads_buckets.items()}
        for gb in buckets:
            bucket_id = bucket_ids[id(gb)]
            if gb.status == zb.GradientStatus.SYNCING:
                self._finish_bucket_grad_sync()
            gb.status = zb.GradientStatus.SYNCING
            gb.grads_generated.clear()
            if gb.grads_bucket is None:
                raise AssertionError("bucket without gradients started a reduction")
            self._flush_deferred_grads([gb])
            self._zero_unwritten(bucket_id, gb)
            if average and self.distributed_size * self.redundant_size > 1:
                gb.grads_bucket.div_(self.distributed_size * self.redundant_size)
            works = []
            if self.distributed_size == 1:
                gb.sync_grads_shard = gb.grads_bucket
            else:
                nbytes = gb.grads_bucket.numel() * gb.grads_bucket.element_size()
                scratch = None
                if takes_gloo_path(group, op):
                    scratch = self._comm_buffer("reduce_scatter", bucket_id, gb.grads_bucket.numel(),
                                                gb.grads_bucket.dtype)
                if scratch is not None and not self.contiguous_grad_buffer:
                    # The sum lands on this rank's own chunk of the reused bucket buffer, which it has just
                    # read: no cold output to fetch (measured: the sum of a 2 MB shard 0.44 ms into a fresh
                    # tensor). The buffer is then lent to grads_shard until zero_grad (_grads_bucket_for).
                    gb.sync_grads_shard = gb.grads_bucket.view(self.distributed_size, -1)[self.distributed_rank]
                else:
                    gb.sync_grads_shard = torch.empty([gb.grads_bucket.numel() // self.distributed_size],
                                                      dtype=gb.grads_bucket.dtype, device=self.device)
                works.append(_reduce_scatter(gb.sync_grads_shard, gb.grads_bucket, op=op,
                                             group=self.distributed_process_group, async_op=True,
                                             scratch=scratch))
                self.comm_stats["reduce_scatter_bytes"] += nbytes
            if self.redundant_size > 1:
                # The all-reduce must follow the reduce-scatter; Gloo/NCCL order works of one rank per group
                # only, so wait here (the redundant group is rare and small).
                for w in works:
                    w.wait()
                works = [dist.all_reduce(gb.sync_grads_shard, op=op, group=self.redundant_process_group,
                                         async_op=True)]
                self.comm_stats["all_reduce_bytes"] += gb.sync_grads_shard.numel() * gb.sync_grads_shard.element_size()
            gb.work = works

    def _finish_bucket_grad_sync(self) -> None:
        """Wait for the reductions in flight and accumulate them into the local gradient shards."""
        for _, gb in sorted(self._grads_buckets.items()):
            if gb.status != zb.GradientStatus.SYNCING:
                continue
            for w in gb.work or []:
                w.wait()
            gb.work = None
            if gb.grads_shard is None:
                # On one rank the reduced shard is the bucket buffer itself, which the next backward would
                # write again: the contiguous buffer's part is copied; a reused buffer stays in the pool, lent
                # to the shard as on several ranks (_grads_bucket_for hands out another while the shard lives,
                # and after zero_grad the same one, so the hooks' cached views and plans stay valid).
                shard = gb.sync_grads_shard
                if self.distributed_size == 1 and self.contiguous_grad_buffer:
                    shard = shard.clone()
                gb.grads_shard = shard
            else:
                gb.grads_shard.add_(gb.sync_grads_shard)
            gb.sync_grads_shard = None
            gb.grads_bucket = None
            gb.status = zb.GradientStatus.READY
            self._grad_norm = None

    def _force_bucket_grad_sync(self) -> None:
        """Reduce every bucket that has local gradients; buckets nobody wrote get zero gradients."""
        pending = []
        for _, gb in sorted(self._grads_buckets.items()):
            if gb.status in (zb.GradientStatus.PARTIALLY_FILLED, zb.GradientStatus.FULLY_FILLED):
                pending.append(gb)
        if pending:
            self._start_bucket_grad_sync(pending)
        self._finish_bucket_grad_sync()
        for bucket_id, sb in enumerate(self.state["buckets"]):
            gb = self._grads_buckets[bucket_id]
            if gb.grads_shard is None:
                gb.grads_shard = torch.zeros([sb.shard_size], dtype=sb.grad_sync_dtype, device=self.device)

    @zb.no_grad
    def _shrink_last_buckets(self) -> None:
        """Fit the last bucket of each dtype triple to its contents, once, before its first reduction.

        Buckets have a fixed capacity, so the last one is usually mostly padding that every rank would store
        and communicate. Before the first step (fresh state) and while its gradients are still local, the
        last bucket can be cut to ``filled_size`` rounded up to ``alignment * distributed_size``; its
        fragments' shard ranges and its state shards are rebuilt (identically on every rank)."""
        if self._buckets_shrunk or self.with_scaled_states or \
                any("fragments" not in self.state[p] for p in self.parameters()):
            return
        self._buckets_shrunk = True
        if not isinstance(self.state["step"], int) or self.state["step"] != 0:
            return
        last: dict = {}
        for i, b in enumerate(self.state["buckets"]):
            last[b.dtypes()] = i
        for bucket_id in last.values():
            b = self.state["buckets"][bucket_id]
            gb = self._grads_buckets.get(bucket_id)
            if gb is not None and gb.status not in (zb.GradientStatus.READY, zb.GradientStatus.PARTIALLY_FILLED,
                                                    zb.GradientStatus.FULLY_FILLED):
                continue
            if gb is not None and gb.grads_shard is not None:
                continue
            shard = zb._round_to_multiple(-(-b.filled_size // self.distributed_size), self.alignment)
            if shard >= b.shard_size:
                continue
            nb = self.StateBucket(shard * self.distributed_size, shard, b.dtype, self.device, b.grad_sync_dtype,
                                  b.param_sync_dtype, b.contiguous_buffer_offset, b.params_shard is not None,
                                  b.param_remainders_shard is not None)
            nb.filled_size, nb.able_to_fill = b.filled_size, False
            rank = self.distributed_rank
            for f in b.fragments:
                b0, b1 = f.bucket_range
                s0 = min(max(b0 - shard * rank, 0), shard)
                s1 = min(max(b1 - shard * rank, 0), shard)
                f.in_local_shard = s0 < s1 and b1 > b0
                f.shard_range = (s0, s1) if f.in_local_shard else None
                f.shard_bucket_range = (s0 + shard * rank, s1 + shard * rank) if f.in_local_shard else None
                f.shard_param_range = ((f.shard_bucket_range[0] - b0 + f.param_range[0],
                                        f.shard_bucket_range[1] - b0 + f.param_range[0]) if f.in_local_shard else None)
                nb.fragments.append(f)
                if f.in_local_shard and nb.params_shard is not None:
                    nb.params_shard[slice(*f.shard_range)].copy_(
                        zb._flat(self.parameter(f))[slice(*f.shard_param_range)])
            self.state["buckets"][bucket_id] = nb
            if gb is not None and gb.grads_bucket is not None:
                gb.grads_bucket = gb.grads_bucket[:nb.bucket_size]

    def grad_sync(self) -> None:
        """Copy any gradients still on the parameters into buckets and finish every reduction."""
        with self._lock:
            self._flush_deferred_grads()
            self._shrink_last_buckets()
            # After a backward the hooks have taken every gradient: one C-level pass finds none left, where
            # the loop below costs a Python call per fragment.
            params = self.__dict__.get("_step_params") or self.parameters()
            if any(map(operator.is_not, map(_grad, params), repeat(None))):
                for sb in self.state["buckets"]:
                    for frag in sb.fragments:
                        p = self.parameter(frag)
                        if p.grad is not None:
                            self._grad_copy(p)
                            if not self.contiguous_grad_buffer:
                                self._try_start_bucket_grad_sync(params=[p])
            self._force_bucket_grad_sync()
