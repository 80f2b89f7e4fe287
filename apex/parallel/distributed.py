"""Apex's ``DistributedDataParallel`` and ``Reducer`` on ``torch.distributed`` (Gloo on CPU, NCCL on GPU).

Gradient maths (Apex's): each bucket is flattened (upcast to fp32 first with ``allreduce_always_fp32``),
multiplied by ``1 / gradient_predivide_factor``, all-reduced (summed), then, with ``gradient_average``,
multiplied by ``gradient_predivide_factor / world_size`` and copied back into the ``.grad`` tensors.

All collectives go through the process group given (the default group when ``None``). A rank that dies or
hangs makes the others fail with PyTorch's timeout error after the ``timeout=`` passed to
``torch.distributed.init_process_group`` (for example ``timeout=datetime.timedelta(seconds=60)``).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.nn import Module

from apex.parallel._comm import (
    Reducer,
    _broadcast_params,
    _group_src,
    apply_flat_dist_call,
    extract_tensors,
    flat_dist_call,
    flatten,
    require_process_group,
    split_by_type,
    split_half_float_double,
    unflatten,
)

__all__ = [
    "DistributedDataParallel",
    "extract_tensors",
    "require_process_group",
    "Reducer",
    "apply_flat_dist_call",
    "flat_dist_call",
    "flatten",
    "split_by_type",
    "split_half_float_double",
    "unflatten",
]


_NULL = contextlib.nullcontext()


class _Step:
    """Bookkeeping of one backward pass: which bucket slots are filled and which all-reduces run."""

    def __init__(self, sizes: list[int]):
        self.slots: list[list[torch.Tensor | None]] = [[None] * n for n in sizes]
        self.ready = [0] * len(sizes)
        self.next_bucket = 0
        self.waiting: set[int] = set()
        self.pending: list[tuple] = []
        self.callback_queued = False


class DistributedDataParallel(Module):
    """Data-parallel wrapper: broadcast parameters from rank 0, all-reduce gradients during ``backward()``.

    Gradients are grouped into buckets of one dtype each, in the order they become ready during the
    first backward pass (rank 0's order is agreed by all ranks). A bucket closes once it holds at least
    ``message_size`` elements (or, with ``allreduce_trigger_params``, when one of those parameters gets
    its gradient). In later iterations each bucket's all-reduce is started asynchronously as soon as all
    its gradients are ready, in bucket order, so communication overlaps the rest of ``backward()``; the
    end of ``backward()`` waits for them and writes the results into ``.grad``. The structure is rebuilt
    whenever the set of parameters with ``requires_grad`` changes.

    A parameter that gets no gradient in a step on some ranks is counted as zero there; one that gets
    no gradient on any rank keeps ``.grad = None``.

    Args:
        module: the network to wrap.
        message_size: minimum number of elements in a bucket (default 1e7).
        delay_allreduce: do all communication at the end of ``backward()`` (one bucket per dtype).
        shared_param: retired; any value other than None raises ValueError.
        allreduce_trigger_params: parameters whose gradient closes a bucket (``message_size`` ignored);
            not allowed with ``delay_allreduce``.
        retain_allreduce_buffers: keep the flat all-reduced buffers (``allreduce_buffers``) and make
            ``.grad`` views into them instead of copying back.
        allreduce_always_fp32: all-reduce fp16/bf16 gradients in fp32.
        num_allreduce_streams: number of process groups the buckets are spread over round-robin (so that
            several all-reduces can be in flight); more than 1 is not allowed with ``delay_allreduce``.
        allreduce_communicators: ``(process_groups, streams)`` to use instead of creating
            ``num_allreduce_streams`` groups; the streams are accepted for compatibility (the
            asynchronous collectives order themselves against the current stream).
        gradient_average: divide the summed gradients by the world size.
        gradient_predivide_factor: scale by ``1/f`` before the all-reduce and ``f/world_size`` after.
        gradient_average_split_factor: deprecated name of ``gradient_predivide_factor``.
        prof: mark the hooks and all-reduces as ``torch.profiler`` ranges.
        process_group: the group to reduce over (default: the whole world); not in Apex.

    Requires ``torch.distributed.init_process_group`` first (RuntimeError otherwise). Pass its
    ``timeout=`` so that a rank that dies makes the others fail instead of waiting forever.
    """

    def __init__(self, module: Module, message_size: int = 10000000, delay_allreduce: bool = False,
                 shared_param=None, allreduce_trigger_params=None, retain_allreduce_buffers: bool = False,
                 allreduce_always_fp32: bool = False, num_allreduce_streams: int = 1,
                 allreduce_communicators=None, gradient_average: bool = True,
                 gradient_predivide_factor: float = 1.0, gradient_average_split_factor=None,
                 prof: bool = False, process_group=None):
        super().__init__()
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported as an option: overlapping communication "
                             "with computation works with shared parameters. To delay communication to the "
                             "end of the backward pass use delay_allreduce=True instead.")
        if not isinstance(module, Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(message_size, bool) or not isinstance(message_size, (int, float)) or message_size < 0:
            raise ValueError(f"message_size must be a non-negative number of elements, got {message_size!r}")
        if not isinstance(num_allreduce_streams, int) or num_allreduce_streams < 1:
            raise ValueError(f"num_allreduce_streams must be an int >= 1, got {num_allreduce_streams!r}")
        if gradient_average_split_factor is not None:
            warnings.warn("gradient_average_split_factor has been renamed to gradient_predivide_factor",
                          DeprecationWarning, stacklevel=2)
            gradient_predivide_factor = gradient_average_split_factor
        if not isinstance(gradient_predivide_factor, (int, float)) or not gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be a positive number, got "
                             f"{gradient_predivide_factor!r}")
        if allreduce_trigger_params is not None and delay_allreduce:
            raise ValueError("allreduce_trigger_params is only valid with delay_allreduce=False")
        if allreduce_communicators is not None:
            if (not isinstance(allreduce_communicators, (list, tuple)) or len(allreduce_communicators) != 2
                    or len(allreduce_communicators[0]) != num_allreduce_streams
                    or len(allreduce_communicators[1]) != num_allreduce_streams or num_allreduce_streams < 2):
                raise ValueError("allreduce_communicators must be (process_groups, streams), each of length "
                                 "num_allreduce_streams (> 1)")
        if num_allreduce_streams > 1 and delay_allreduce:
            raise ValueError("num_allreduce_streams > 1 may only be used with delay_allreduce=False")
        require_process_group("apex.parallel.DistributedDataParallel")

        self.module = module
        self.message_size = int(message_size)
        self.delay_allreduce = bool(delay_allreduce)
        self.retain_allreduce_buffers = bool(retain_allreduce_buffers)
        self.allreduce_always_fp32 = bool(allreduce_always_fp32)
        self.num_allreduce_streams = num_allreduce_streams
        self.allreduce_different_streams = num_allreduce_streams > 1
        self.allreduce_communicators = allreduce_communicators
        self.gradient_average = bool(gradient_average)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.prof = bool(prof)
        self.process_group = process_group
        self.world_size = float(dist.get_world_size(process_group))
        self.custom_allreduce_triggers = allreduce_trigger_params is not None
        self.allreduce_trigger_params = ({id(p) for p in allreduce_trigger_params}
                                         if self.custom_allreduce_triggers else set())
        self._disable_allreduce = False

        if allreduce_communicators is not None:
            self.bucket_pgs = list(allreduce_communicators[0])
        elif self.allreduce_different_streams:
            # new_group is collective over the default group: every rank builds its DDP, so all call it.
            ranks = dist.get_process_group_ranks(process_group) if process_group is not None else None
            self.bucket_pgs = [dist.new_group(ranks=ranks) for _ in range(num_allreduce_streams)]
        else:
            self.bucket_pgs = [process_group]

        # Bucket structure (Apex's names): lists of indices into active_params.
        self.active_params: list[torch.nn.Parameter] = []
        self.active_i_buckets: list[list[int]] = []
        self.bucket_sizes: list[int] = []
        self.num_buckets = 0
        self.needs_refresh = True
        self.allreduce_buffers: list[torch.Tensor | None] = []
        self._param_index: dict[int, int] = {}
        self._bucket_of: dict[int, tuple[int, int]] = {}
        self._record: list[int] = []
        self._buffers: dict[int, tuple] = {}
        self._signature: list = []
        self._step: _Step | None = None
        self._hooked: set[int] = set()
        self._hook_handles: list = []
        self.allreduce_calls = 0  # all-reduces issued by this wrapper so far (for benchmarks)

        _broadcast_params(list(self.module.parameters()), process_group)
        self._register_hooks()

    # -- public switches ----------------------------------------------------------------------------
    def enable_allreduce(self) -> None:
        """Reduce gradients again from the next backward pass on."""
        self._disable_allreduce = False

    def disable_allreduce(self) -> None:
        """Skip the all-reduce (gradients only accumulate locally), e.g. between accumulation steps."""
        self._disable_allreduce = True

    def forward(self, *inputs, **kwargs):
        params = [p for p in self.module.parameters() if p.requires_grad]
        self._register_hooks(params)
        # A conversion after construction (model.half(), .to(device)) keeps the Parameter objects but
        # changes what the buckets hold, so the signature includes dtype and device too.
        signature = [(p.dtype, p.device, p.shape) for p in params]
        changed = (len(params) != len(self.active_params) or signature != self._signature
                   or any(a is not b for a, b in zip(params, self.active_params)))
        if changed:
            self._signature = signature
            self.active_params = params
            self._param_index = {id(p): i for i, p in enumerate(params)}
            self.needs_refresh = True
            if self.delay_allreduce:
                self._build_dtype_buckets()
        self._step = None
        return self.module(*inputs, **kwargs)

    # -- hooks ----------------------------------------------------------------------------------------
    def _register_hooks(self, params=None) -> None:
        ref = weakref.ref(self)
        for p in (self.module.parameters() if params is None else params):
            if p.requires_grad and id(p) not in self._hooked:
                def hook(param, ref=ref):
                    owner = ref()
                    if owner is not None:
                        owner._grad_ready(param)
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))
                self._hooked.add(id(p))

    def _range(self, name: str):
        return torch.profiler.record_function(name) if self.prof else _NULL

    def _grad_ready(self, param: torch.Tensor) -> None:
        if self._disable_allreduce:
            return
        i = self._param_index.get(id(param))
        if i is None:  # requires_grad switched on after the last forward: picked up next forward
            return
        with self._range("allreduce_hook"):
            step = self._step
            if step is None:
                if self.needs_refresh and not self.delay_allreduce:
                    self._record = []
                step = self._step = _Step(self.bucket_sizes)
            if not step.callback_queued:
                torch.autograd.Variable._execution_engine.queue_callback(self._epilogue)
                step.callback_queued = True
            if self.delay_allreduce:
                return
            if self.needs_refresh:
                self._record.append(i)
                return
            self._comm_ready_buckets(step, i, param)

    def _comm_ready_buckets(self, step: _Step, i: int, param: torch.Tensor) -> None:
        b, loc = self._bucket_of[i]
        if step.slots[b][loc] is not None:
            raise RuntimeError("the backward pass is filling a gradient bucket slot twice (a second backward "
                               "through the same graph without a forward in between?)")
        step.slots[b][loc] = param.grad
        step.ready[b] += 1
        if step.ready[b] == self.bucket_sizes[b]:
            step.waiting.add(b)
            # Buckets are launched in index order on every rank so that the collectives match.
            while step.next_bucket in step.waiting:
                step.waiting.discard(step.next_bucket)
                self._launch(step, step.next_bucket)
                step.next_bucket += 1

    # -- bucket structure --------------------------------------------------------------------------------
    def _build_dtype_buckets(self) -> None:
        order = list(range(len(self.active_params)))
        buckets: dict[torch.dtype, list[int]] = OrderedDict()
        for i in order:
            buckets.setdefault(self.active_params[i].dtype, []).append(i)
        self._set_structure(list(buckets.values()))
        self.needs_refresh = False

    def _set_structure(self, buckets: list[list[int]]) -> None:
        self.active_i_buckets = buckets
        self.bucket_sizes = [len(b) for b in buckets]
        self.num_buckets = len(buckets)
        self._bucket_of = {i: (b, loc) for b, bucket in enumerate(buckets) for loc, i in enumerate(bucket)}
        self.allreduce_buffers = [None] * self.num_buckets
        self._buffers = {}

    def _propose_buckets(self) -> list[list[int]]:
        """This rank's buckets from the recorded ready order (parameters never ready appended)."""
        n = len(self.active_params)
        seen = set(self._record)
        order = self._record + [i for i in range(n) if i not in seen]
        buckets: list[list[int]] = []
        tmp: dict[torch.dtype, list[int]] = OrderedDict()
        numel: dict[torch.dtype, int] = {}
        for i in order:
            p = self.active_params[i]
            tmp.setdefault(p.dtype, []).append(i)
            numel[p.dtype] = numel.get(p.dtype, 0) + p.numel()
            if self.custom_allreduce_triggers:
                ship = id(p) in self.allreduce_trigger_params
            else:
                ship = numel[p.dtype] >= self.message_size
            if ship:
                buckets.append(tmp.pop(p.dtype))
                numel[p.dtype] = 0
        buckets.extend(b for b in tmp.values() if b)
        return buckets

    def _sync_bucket_structure(self) -> None:
        """Adopt rank 0's bucket structure: one broadcast of [num_buckets, sizes..., indices...]."""
        n = len(self.active_params)
        buckets = self._propose_buckets()
        info = torch.full((1 + 2 * n,), -1, dtype=torch.int64)
        info[0] = len(buckets)
        info[1:1 + len(buckets)] = torch.tensor([len(b) for b in buckets], dtype=torch.int64)
        info[1 + n:] = torch.tensor([i for b in buckets for i in b], dtype=torch.int64)
        device = self._comm_device()
        info = info.to(device)
        dist.broadcast(info, _group_src(self.process_group), group=self.process_group)
        info = info.cpu().tolist()
        nb = info[0]
        sizes = info[1:1 + nb]
        flat = info[1 + n:]
        agreed, pos = [], 0
        for s in sizes:
            agreed.append(flat[pos:pos + s])
            pos += s
        self._set_structure(agreed)

    def _comm_device(self) -> torch.device:
        backend = dist.get_backend(self.process_group)
        if backend == "nccl" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # -- communication -------------------------------------------------------------------------------------
    def _bucket_buffer(self, b: int, params: list[torch.Tensor]):
        """``(flat, views)``: the bucket's flat buffer (gradients, then one presence count per parameter)
        and views of it shaped like the parameters. Kept between steps unless the buffers are handed to
        the user (``retain_allreduce_buffers``), so a step allocates and slices nothing."""
        cached = None if self.retain_allreduce_buffers else self._buffers.get(b)
        if cached is not None:
            return cached
        numels = [p.numel() for p in params]
        n = sum(numels)
        flat = torch.empty(n + len(params), dtype=params[0].dtype, device=params[0].device)
        views = [v.view_as(p) for v, p in zip(flat[:n].split(numels), params)]
        if not self.retain_allreduce_buffers:
            self._buffers[b] = (flat, views)
        return flat, views

    def _launch(self, step: _Step, b: int) -> None:
        """Flatten bucket ``b`` (missing gradients as zeros, plus one presence count per parameter) and
        start its all-reduce without waiting."""
        with self._range("allreduce_bucket"):
            params = [self.active_params[i] for i in self.active_i_buckets[b]]
            slots = step.slots[b]
            for loc, p in enumerate(params):
                if slots[loc] is None and p.grad is not None:
                    slots[loc] = p.grad  # accumulated in earlier (non-reducing) passes
            flat, views = self._bucket_buffer(b, params)
            n = flat.numel() - len(params)
            all_present = all(g is not None for g in slots)
            if all_present:
                torch._foreach_copy_(views, slots)
                flat[n:].fill_(1)  # the common case: no host-to-device copy
            else:
                have = [i for i, g in enumerate(slots) if g is not None]
                if have:
                    torch._foreach_copy_([views[i] for i in have], [slots[i] for i in have])
                for v, g in zip(views, slots):
                    if g is None:
                        v.zero_()
                flat[n:].copy_(torch.tensor([g is not None for g in slots], dtype=flat.dtype))
            red = flat
            if self.allreduce_always_fp32 and flat.dtype in (torch.float16, torch.bfloat16):
                red = flat.float()
            if self.gradient_predivide_factor != 1.0:
                red[:n].mul_(1.0 / self.gradient_predivide_factor)
            group = self.bucket_pgs[b % len(self.bucket_pgs)]
            work = dist.all_reduce(red, group=group, async_op=True)
            self.allreduce_calls += 1
            step.pending.append((b, work, flat, red, views, all_present))

    def _finish(self, step: _Step, b: int, work, flat, red, views, all_present: bool) -> None:
        work.wait()
        params = [self.active_params[i] for i in self.active_i_buckets[b]]
        n = flat.numel() - len(params)
        if self.gradient_average:
            red[:n].mul_(self.gradient_predivide_factor / self.world_size)
        if red is not flat:
            flat.copy_(red)
        # Parameters with a local gradient are present by construction; only when some are missing here
        # does the (host-synchronising) look at the all-reduced presence counts happen.
        present = [True] * len(params) if all_present else (flat[n:] != 0).tolist()
        if self.retain_allreduce_buffers:
            self.allreduce_buffers[b] = flat[:n]
            for p, v, ok in zip(params, views, present):
                if ok:
                    p.grad = v
            return
        if all_present:
            torch._foreach_copy_([p.grad for p in params], views)
            return
        copy_dst, copy_src = [], []
        for p, v, ok in zip(params, views, present):
            if not ok:
                continue
            if p.grad is None:
                p.grad = v.clone()
            else:
                copy_dst.append(p.grad)
                copy_src.append(v)
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)

    def _epilogue(self) -> None:
        step = self._step
        self._step = None
        if step is None:
            return
        with self._range("allreduce_epilogue"):
            if self.needs_refresh and not self.delay_allreduce:
                self._sync_bucket_structure()
                self.needs_refresh = False
                step = _Step(self.bucket_sizes)
            # Start every bucket not yet started, in order; unfilled slots take param.grad or zeros.
            for b in range(step.next_bucket, self.num_buckets):
                self._launch(step, b)
            step.next_bucket = self.num_buckets
            for item in step.pending:
                self._finish(step, *item)
