"""Parameter all-gather of ``DistributedFusedAdam`` and its pre-forward hooks (``overlap_param_sync``).

After a step each rank holds its updated shard of every bucket; the buckets are all-gathered (asynchronously,
as ``torch.distributed`` works) and written into the parameters either at once (``param_sync``) or, with
``overlap_param_sync``, when a torch operation first uses a parameter: the parameter's class is swapped for a
subclass whose ``__torch_function__`` finishes its bucket's all-gather first. The gradient side is
``_zero_comm``.
"""

from __future__ import annotations

import operator

import torch
from torch.utils._pytree import tree_flatten

from apex.contrib.optimizers import _zero_buckets as zb
from apex.contrib.optimizers._gloo_collectives import all_gather_into_tensor as _all_gather

_PENDING_CLASSES: dict = {}
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


class ZeroParamSyncMixin:
    """The parameter side of ``ZeroCommMixin``: all-gather the updated shards and write the parameters."""

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
                if type(self)._param_copy_fragments is ZeroParamSyncMixin._param_copy_fragments:
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
