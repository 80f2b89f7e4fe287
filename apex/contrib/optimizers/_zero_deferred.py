"""The fast path of ``DistributedFusedAdam``'s gradient hook: whole gradients queued, then copied into their
bucket together.

The hook runs once per parameter per backward, in Python. Its general path (``_grad_copy`` and
``_try_start_bucket_grad_sync``) costs about 15 us per parameter on a CPU next to a 2-4 us copy, which is
most of the optimizer's overhead for a model of many small parameters. Once the buckets have their final
size (the first step cuts the last one), a parameter that is one whole fragment of a bucket (the usual
case) takes this path instead: its gradient is
queued on the bucket (after the same bookkeeping: written, generated), and the queue is copied in one
``torch._foreach_copy_`` when the bucket's reduction starts, when backward ends (an autograd final
callback), or before anything else reads or writes the bucket (``_grad_copy``, ``grad_sync``). The
gradients stay on the parameters until then and are dropped after the copy, so after backward every
``param.grad`` is None, as with the general path. A gradient of ``_COPY_NOW`` elements or more is copied
at once instead of queued: its per-parameter Python is small next to its copy, and the backward that wrote it
still has it in cache (measured on 2 CPU ranks, MLP 4x512: backward 4.1 -> 3.8-3.95 ms of CPU per step).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from operator import attrgetter, eq, is_

import torch

from apex import _backend
from apex._kernels._lists import column
from apex.contrib.optimizers import _zero_buckets as zb

_COPY_NOW = 1 << 16  # elements: from here on a whole gradient is copied in the hook rather than queued
_grad = attrgetter("grad")
_shape = attrgetter("shape")
_dtype = attrgetter("dtype")
_contiguous = torch.Tensor.is_contiguous
_PARTIAL = zb.GradientStatus.PARTIALLY_FILLED
_FULL = zb.GradientStatus.FULLY_FILLED


class ZeroDeferredGradMixin:
    def _defer_grad_copy(self, param: torch.nn.Parameter) -> bool:
        """Queue ``param.grad`` for its bucket if the parameter's plan still holds; False: take the general
        path. Counts the gradient as generated and starts the bucket's reduction once it is complete.

        Once per parameter per backward, in Python: the usual case reads the plan, the bucket's state and
        nothing of the gradient (it is read by the flush, in one C-level pass for the bucket; one removed
        meanwhile leaves zeros there)."""
        plan = self._deferred_plans.get(id(param))
        if plan is None or plan[0] is not param or not (self.greedy_grad_copy and self.overlap_grad_sync):
            return False
        _, bucket_id, buf, dst, key, sb, numel = plan
        gb = self._grads_buckets.get(bucket_id)
        # The bucket must be this step's reused buffer, handed out already (its first gradient took the
        # general path), not reducing, and this fragment not yet written in it (a copy, not an add).
        if gb is None or gb.grads_bucket is not buf or gb.status is not _PARTIAL:
            return False
        written = gb.written
        if written is None or key in written or self.state["buckets"][bucket_id] is not sb:
            return False
        if numel >= _COPY_NOW:
            grad = param.grad
            if grad is None:
                return False
            if grad.is_contiguous() and grad.shape == dst.shape and grad.dtype == dst.dtype:
                # A large gradient is copied while the backward that wrote it still has it in cache.
                written.add(key)
                dst.copy_(grad)
                param.grad = None
                gb.note_generated(key, len(sb.fragments))
                if gb.status is _FULL:
                    self._try_start_bucket_grad_sync()
                return True
        if not self._deferred_flush_queued:
            try:  # copy whatever is still queued when this backward ends
                torch.autograd.Variable._execution_engine.queue_callback(self._flush_deferred_grads)
            except RuntimeError:  # not inside a backward: nothing would flush the queue
                return False
            self._deferred_flush_queued = True
        written.add(key)
        gb.deferred.append((param, dst))
        self._has_deferred = True
        generated = gb.grads_generated  # (GradientBucket.note_generated, inline)
        generated.add(key)
        if len(generated) == len(sb.fragments):
            gb.status = _FULL
            self._try_start_bucket_grad_sync()
        return True

    def _plan_deferred_grad_copy(self, param: torch.nn.Parameter) -> None:
        """After the general path copied ``param``'s gradient: remember where it went if the parameter is
        one whole fragment of a bucket whose buffer is reused step to step (not the contiguous buffer)."""
        frags = self.state[param].get("fragments", ())
        cached = self._grad_views.get(id(frags[0])) if len(frags) == 1 else None
        if (cached is None or cached[0] is not frags[0] or not cached[4] or self.contiguous_grad_buffer
                or cached[2].shape != param.shape):
            self._deferred_plans.pop(id(param), None)
            return
        frag = frags[0]
        self._deferred_plans[id(param)] = (param, frag.bucket_id, cached[1], cached[2], cached[3],
                                           self.state["buckets"][frag.bucket_id], cached[2].numel())

    @zb.no_grad
    def _flush_deferred_grads(self, buckets=None) -> None:
        """Copy the queued gradients of ``buckets`` (default: all) into place and drop them from the
        parameters. A gradient removed meanwhile leaves zeros (its fragment counts as written)."""
        with self._lock:
            if buckets is None:
                self._deferred_flush_queued = False
                if not self._has_deferred:
                    return
                self._has_deferred = False
                buckets = list(self._grads_buckets.values())
            for gb in buckets:
                queued = gb.deferred
                if not queued:
                    continue
                gb.deferred = []
                params, dsts = zip(*queued)
                grads = list(map(_grad, params))
                # The usual case, checked in C-level passes: every gradient still there, in the layout and
                # dtype its view was planned for (a whole contiguous gradient has its parameter's shape).
                if (not any(map(is_, grads, repeat(None))) and all(map(_contiguous, grads))
                        and all(map(eq, map(_shape, grads), map(_shape, dsts)))
                        and all(map(is_, map(_dtype, grads), map(_dtype, dsts)))):
                    _copy_all(dsts, grads, self._copy_flags)
                else:
                    _copy_each(dsts, grads)
                deque(map(setattr, params, repeat("grad"), repeat(None)), maxlen=0)


def _copy_all(dsts, grads, flags: dict) -> None:
    """``dst.copy_(grad)`` for every pair, all of one dtype: on the Triton path apex's multi-tensor copy (one
    launch, as Apex copies; the gradients' addresses change every step, so its table is built each time),
    else one ``torch._foreach_copy_``. ``flags``: the optimizer's flag tensors of those copies, by device."""
    first = dsts[0]
    if _backend.select_tensor(first) == "triton":
        from apex.ops.multi_tensor_scale import multi_tensor_scale

        flag = flags.get(first.device)
        if flag is None:  # (what it flags is not read: the reduction's norm finds non-finite gradients)
            flag = flags[first.device] = torch.zeros([1], dtype=torch.int32, device=first.device)
        # Columns: the lists were checked above, the engine reads nothing again
        multi_tensor_scale(2048 * 32, flag, [column(grads, dtype=first.dtype, device=first.device),
                                             column(dsts, dtype=first.dtype, device=first.device)], 1.0)
    else:
        torch._foreach_copy_(list(dsts), grads)


def _copy_each(dsts, grads) -> None:
    """The general case of :meth:`ZeroDeferredGradMixin._flush_deferred_grads`: a gradient removed meanwhile
    leaves zeros, one in another layout or dtype than planned is copied in memory order, as _grad_copy does."""
    same_dsts, same_grads = [], []
    for dst, g in zip(dsts, grads):
        if g is None:
            dst.zero_()
        elif g.is_contiguous() and g.shape == dst.shape and g.dtype == dst.dtype:
            same_dsts.append(dst)
            same_grads.append(g)
        else:
            dst.view(-1).copy_(zb._flat(g))
    if same_dsts:
        torch._foreach_copy_(same_dsts, same_grads)
