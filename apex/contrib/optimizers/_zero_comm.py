"""Gradient reduce-scatter and parameter all-gather of ``DistributedFusedAdam`` (its step: ``_zero_step``).

Collectives are asynchronous ``torch.distributed`` works (on Gloo through ``_gloo_collectives``, NCCL on GPUs);
a bucket's work is waited for when its result is first needed. Every rank issues the same collectives in
the same order because buckets become full in the same (backward) order on every rank.
"""

from __future__ import annotations

import operator
from itertools import repeat

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from apex.contrib.optimizers import _zero_buckets as zb
from apex.contrib.optimizers._gloo_collectives import all_gather_into_tensor as _all_gather
from apex.contrib.optimizers._gloo_collectives import reduce_scatter_tensor as _reduce_scatter
from apex.contrib.optimizers._gloo_collectives import takes_gloo_path

_PENDING_CLASSES: dict = {}
_grad = operator.attrgetter("grad")
_fragments = operator.attrgetter("fragments")
_ptr = torch.Tensor.data_ptr


def _pending_args(args: tuple, kwargs: dict) -> list:
    """The arguments of a torch call that are parameters with an armed pre-forward hook. Torch operations
    take tensors directly or in lists (``cat``, the foreach ops), so those are scanned without building a
    pytree (measured: tree_flatten was most of the cost of every first use of a parameter); anything else
    nested goes through tree_flatten."""
    found = []
    for group in (args, kwargs.values()):
        for a in group:
            if isinstance(a, torch.Tensor):
                if getattr(a, "_pre_forward_hook_is_enabled", False) and type(a) in _PENDING_CLASSES.values():
                    found.append(a)
            elif isinstance(a, (list, tuple, dict)):
                found.extend(t for t in tree_flatten(a)[0] if isinstance(t, torch.Tensor)
                             and getattr(t, "_pre_forward_hook_is_enabled", False)
                             and type(t) in _PENDING_CLASSES.values())
    return found


def _pending_class(cls: type) -> type:
    """A subclass of ``cls`` whose torch operations first finish the parameter's pending all-gather."""
    if cls not in _PENDING_CLASSES:
        def __torch_function__(sub, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for a in _pending_args(args, kwargs):
                a._pre_forward_hook_is_enabled = False
                a._pre_forward_hook()
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        _PENDING_CLASSES[cls] = type(f"_PendingSync{cls.__name__}", (cls,),
                                     {"__torch_function__": classmethod(__torch_function__)})
    return _PENDING_CLASSES[cls]


class ZeroCommMixin:
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

    # -- parameters ----------------------------------------------------------------------------------------

    def _start_bucket_param_sync(self, buckets) -> None:
        buckets = [b for b in buckets if b.status == zb.ParameterStatus.SHARDED]
        for pb in buckets:
            pb.status = zb.ParameterStatus.SYNCING
            if pb.params_bucket is None and self.distributed_size == 1:
                pb.params_bucket = pb.params_shard
            elif pb.params_bucket is None:
                pb.params_bucket = torch.empty([pb.params_shard.numel() * self.distributed_size],
                                               dtype=pb.params_shard.dtype, device=self.device)
            if self.distributed_size > 1:
                pb.work = _all_gather(pb.params_bucket, pb.params_shard, group=self.distributed_process_group,
                                      async_op=True)
                self.comm_stats["all_gather_bytes"] += pb.params_bucket.numel() * pb.params_bucket.element_size()

    def _finish_bucket_param_sync(self) -> None:
        for pb in self._params_buckets.values():
            if pb.status == zb.ParameterStatus.SYNCING:
                if pb.work is not None:
                    pb.work.wait()
                pb.work = None
                pb.params_shard = None
                pb.status = zb.ParameterStatus.READY

    def _param_copy_fragments(self, fragments) -> None:
        frags = [f for f in fragments if f.param_range[1] > f.param_range[0] and f.bucket_id in self._params_buckets]
        # A bucket whose own part step() already wrote (_write_own_params) copies only the other ranks' parts.
        self._param_copy_part(frags, tuple(self._params_buckets[f.bucket_id].own_written for f in frags))

    def _param_copy_part(self, frags, parts: tuple) -> None:
        """Copy ``frags`` from their gathered buckets into the parameters: per fragment, the whole of it
        (part False), only this rank's own shard of it ("own") or all but that (True)."""
        params = [self.parameter(f) for f in frags]
        buffers = [self._params_buckets[f.bucket_id].params_bucket for f in frags]
        # The views are rebuilt only when a fragment, a parameter's storage or a bucket buffer changed: the
        # buffers are reused every step (_comm_buffer), so a model of many small parameters saves the per-view
        # Python work of every step.
        # One entry per set of fragments asked for: (overlap_param_sync) one parameter per pre-forward hook.
        ids = tuple(map(id, frags)), parts
        ptrs = tuple(p.data_ptr() for p in params), tuple(b.data_ptr() for b in buffers)
        cached = self._param_copy_cache.get(ids)
        if cached is None or cached[0] != ptrs:
            self._trim_param_copy_cache()
            # The entry holds the fragments, so their ids cannot be reused by other fragments while it lives.
            cached = self._param_copy_cache[ids] = (ptrs, self._plan_param_copy(frags, params, buffers, parts),
                                                    frags)
        zb._run_copy_plan(cached[1])

    def _trim_param_copy_cache(self) -> None:
        if len(self._param_copy_cache) > 2 * sum(len(g["params"]) for g in self.param_groups) + 4:
            self._param_copy_cache.clear()  # stale entries of replaced fragments or buffers

    @staticmethod
    def _plan_param_copy(frags, params, buffers, parts) -> list:
        ins, outs = [], []
        for f, p, b, part in zip(frags, params, buffers, parts):
            (b0, b1), p0, flat = f.bucket_range, f.param_range[0], zb._flat(p)
            # this rank's part of the fragment, in bucket coordinates (empty when it owns none of it)
            o0, o1 = f.shard_bucket_range if f.in_local_shard else (b1, b1)
            pieces = [(b0, b1)] if not part else [(o0, o1)] if part == "own" else [(b0, o0), (o1, b1)]
            for c0, c1 in pieces:
                if c0 < c1:
                    ins.append(b[c0:c1])
                    outs.append(flat[p0 + c0 - b0:p0 + c1 - b0])
        return zb._copy_plan(ins, outs, keep=True)

    def _param_copy_buckets(self, parts: dict) -> None:
        """Copy every fragment of the pending buckets ``parts`` names (bucket id -> the part of each
        fragment, as in :meth:`_param_copy_part`) into the parameters. What a step's copy depends on is
        checked in a few C-level passes, whatever the number of parameters: the buckets asked for and their
        buffers' addresses, the bucket list and each bucket's number of fragments (a bucket's fragments
        change only with the bucket: appended, or a bucket replaced when cut to size or loaded), the
        parameter list and each parameter's address (``param.data = ...``). The plan is built again when any
        of them changed."""
        pending = self._params_buckets
        buckets = self.state["buckets"]
        # (within step() the list init_params checked: the plan built from it holds that very tuple)
        params = self.__dict__.get("_step_params") or tuple(self.parameters())
        asked = tuple(parts.items())
        key = (asked, tuple(pending[i].params_bucket.data_ptr() for i, _ in asked),
               tuple(map(len, map(_fragments, buckets))))
        entry_id = ("buckets", tuple(parts))
        cached = self._param_copy_cache.get(entry_id)
        # (the addresses are compared as they are read: a tuple of them, built from a map of unknown length,
        # cost more in reallocations than the reads)
        if (cached is None or cached[0] != key or len(cached[2]) != len(buckets)
                or not all(map(operator.is_, cached[2], buckets))
                or cached[3] is not params and (len(cached[3]) != len(params)
                                                or not all(map(operator.is_, cached[3], params)))
                or not all(map(operator.eq, map(_ptr, params), cached[4]))):
            self._trim_param_copy_cache()
            frags = [f for i, _ in asked for f in buckets[i].fragments if f.param_range[1] > f.param_range[0]]
            plan = self._plan_param_copy(frags, [self.parameter(f) for f in frags],
                                         [pending[f.bucket_id].params_bucket for f in frags],
                                         [parts[f.bucket_id] for f in frags])
            # The entry holds the parameters and buckets, so their ids are not reused while it lives.
            cached = self._param_copy_cache[entry_id] = (key, plan, tuple(buckets), params,
                                                         [p.data_ptr() for p in params])
        zb._run_copy_plan(cached[1])

    def _param_copy(self, params) -> None:
        """Write the gathered values of ``params`` into them, waiting for their buckets if needed."""
        params = [params] if isinstance(params, torch.Tensor) else params
        pending = self._params_buckets
        frags = [f for p in params for f in self.state[p].get("fragments", ()) if f.bucket_id in pending]
        if not frags:
            return
        buckets = {f.bucket_id: pending[f.bucket_id] for f in frags}
        if any(b.status is not zb.ParameterStatus.READY for b in buckets.values()):
            self._start_bucket_param_sync(list(buckets.values()))
            self._finish_bucket_param_sync()
        self._param_copy_fragments(frags)
        for f in frags:
            buckets[f.bucket_id].params_updated.add((f.param_group_id, f.param_id))
        for bucket_id, pb in buckets.items():
            # A bucket is released once every parameter with a fragment in it has been written.
            if pb.params_needed is None:
                pb.params_needed = len({(g.param_group_id, g.param_id)
                                        for g in self.state["buckets"][bucket_id].fragments})
            if len(pb.params_updated) >= pb.params_needed:
                del self._params_buckets[bucket_id]

    def _try_start_bucket_param_sync(self, params=None) -> None:
        """Start the all-gathers of ``params``' pending buckets (Apex's): those not started yet. Without
        ``params`` and with no all-gather in flight, the first pending bucket's (a prefetch)."""
        pending = self._params_buckets
        if params is None:
            if any(pb.status is zb.ParameterStatus.SYNCING for pb in pending.values()):
                return
            ids = [next((i for i, pb in pending.items() if pb.status is zb.ParameterStatus.SHARDED), None)]
        else:
            params = [params] if isinstance(params, torch.Tensor) else params
            ids = sorted({f.bucket_id for p in params for f in self.state[p].get("fragments", ())})
        buckets = [pending[i] for i in ids if i in pending and pending[i].status is zb.ParameterStatus.SHARDED]
        if buckets:
            self._start_bucket_param_sync(buckets)

    def param_sync(self) -> None:
        """Finish every pending parameter all-gather and write the parameters."""
        with self._lock:
            # Every parameter is written here, so the pre-forward hooks go first: a subclass's
            # _param_copy_fragments that touches the parameters must not re-enter the copy through them.
            if self._pre_forward_armed:
                for p in self.parameters():
                    self._restore_param_class(p)
                self._pre_forward_armed = False
            if self._params_buckets:
                self._start_bucket_param_sync(list(self._params_buckets.values()))
                self._finish_bucket_param_sync()
                if type(self)._param_copy_fragments is ZeroCommMixin._param_copy_fragments:
                    # every bucket is written whole (param_sync releases them all): no per-parameter lookup
                    self._param_copy_buckets({i: pb.own_written for i, pb in self._params_buckets.items()})
                else:  # a subclass's own copy (NeMo's) gets the fragments, parameter by parameter
                    self._param_copy(list(self.parameters()))
            self._params_buckets.clear()

    def _make_pre_forward_hook(self, param, param_group_id: int, param_id: int):
        def pre_forward_hook(*unused) -> None:
            with self._lock:
                # The first use of any parameter of a bucket waits for the bucket's all-gather anyway, so every
                # parameter in it is written now, in one copy, and disarmed: a model of many small parameters
                # then pays one hook per bucket instead of one per parameter.
                mates = self._bucket_mates(param)
                for p in mates:
                    self._restore_param_class(p)
                self._param_copy(mates)
        return pre_forward_hook

    def _bucket_mates(self, param) -> list:
        """``param`` and the parameters that share a pending parameter bucket with it."""
        frags = self.state[param].get("fragments", ())
        buckets = {f.bucket_id for f in frags if f.bucket_id in self._params_buckets}
        mates = {id(param): param}
        for bucket_id in sorted(buckets):
            for f in self.state["buckets"][bucket_id].fragments:
                p = self.parameter(f)
                mates.setdefault(id(p), p)
        return list(mates.values())

    def _arm_pre_forward_hooks(self) -> None:
        """Defer each parameter's write until a torch operation first uses it (``overlap_param_sync``)."""
        self._pre_forward_armed = True
        for gi, group in enumerate(self.param_groups):
            for pi, p in enumerate(group["params"]):
                if type(p) not in _PENDING_CLASSES.values():
                    p.__class__ = _pending_class(type(p))
                # The hook is made once per parameter and place (every step re-arms the same one).
                owner = getattr(getattr(p, "_pre_forward_hook", None), "_owner", None)
                if owner is None or owner[0] is not self or owner[1] != (gi, pi):
                    p._pre_forward_hook = self._make_pre_forward_hook(p, gi, pi)
                    p._pre_forward_hook._owner = (self, (gi, pi))
                p._pre_forward_hook_is_enabled = True

    @staticmethod
    def _restore_param_class(p) -> None:
        if getattr(p, "_pre_forward_hook_is_enabled", None) is not None:
            p._pre_forward_hook_is_enabled = False
        if type(p) in _PENDING_CLASSES.values():
            p.__class__ = type(p).__mro__[1]
