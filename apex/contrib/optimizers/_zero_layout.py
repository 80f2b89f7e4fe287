"""Bucket and shard layout of ``DistributedFusedAdam``: where each parameter's fragments lie in the buckets
(``init_params``, ``init_params_bucket``, ``_init_param_state``) and the contiguous parameter and gradient
buffers that mirror that layout (``init_param_buffer``, ``grad_buffer_view``)."""

from __future__ import annotations

import operator
import warnings
from collections import defaultdict

import torch

from apex._errors import AssertRuntimeError
from apex.contrib.optimizers import _zero_buckets as zb
from apex.contrib.optimizers._zero_buckets import _round_to_multiple


class ZeroLayoutMixin:
    """Places parameters in buckets: each is split into fragments appended to the last bucket of its dtypes,
    every rank owning one contiguous shard of each bucket."""


    def init_params(self, params=None, dtype=None, grad_sync_dtype=None, param_sync_dtype=None) -> None:
        """Place parameters (default: all) in buckets now instead of at their first gradient."""
        every = params is None
        if every:
            # Every step calls this. Once all parameters are placed, a call only checks that the parameter
            # list and the bucket list are those it saw then, in one C-level pass over the groups' lists
            # without building a tuple (a parameter is unplaced again only by a format-1 load_state_dict,
            # which replaces the bucket list). The tuple it keeps is then the step's verified parameter list.
            placed = self.__dict__.get("_all_placed")
            if (placed is not None and placed[1] is self.state["buckets"]
                    and sum(len(g["params"]) for g in self.param_groups) == len(placed[0])
                    and all(map(operator.is_, placed[0], self.parameters()))):
                return
            params = tuple(self.parameters())
        elif isinstance(params, torch.Tensor):
            params = [params]
        # .get: indexing the state (a defaultdict) would add an entry for a parameter it does not hold
        pending = [p for p in params if "fragments" not in self.state.get(p, ())]
        if not pending:
            if every:
                self._all_placed = (params, self.state["buckets"])
            return
        ids = self._held_ids(pending, "init_params")
        for p in pending:
            self._init_param_state(p, *ids[p], dtype=dtype, grad_sync_dtype=grad_sync_dtype,
                                   param_sync_dtype=param_sync_dtype)
        if every:
            self._all_placed = (params, self.state["buckets"])

    def _held_ids(self, params, caller: str) -> dict:
        """The (group, index) map of every parameter, once each of ``params`` is checked to be held."""
        ids = self._id_map()
        if any(p not in ids for p in params):
            raise ValueError(f"{caller} got a parameter this optimizer does not hold")
        return ids

    def init_params_bucket(self, params, dtype=None, grad_sync_dtype=None, param_sync_dtype=None) -> None:
        """Place ``params`` together in new buckets that communicate together (an empty fragment of every
        parameter in each of them)."""
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        params = [p for p in params if "fragments" not in self.state.get(p, ())]
        if not params:
            return
        ids = self._held_ids(params, "init_params_bucket")
        for bucket in self.state["buckets"]:
            bucket.able_to_fill = False
        start = len(self.state["buckets"])
        self.init_params(params, dtype=dtype, grad_sync_dtype=grad_sync_dtype, param_sync_dtype=param_sync_dtype)
        for bucket_id in range(start, len(self.state["buckets"])):
            bucket = self.state["buckets"][bucket_id]
            bucket.able_to_fill = False
            present = {(f.param_group_id, f.param_id) for f in bucket.fragments}
            for p in params:
                if ids[p] not in present:
                    n, b = p.numel(), bucket.bucket_size
                    frag = self.ParameterFragment(*ids[p], bucket_id, (n, n), (b, b), False, None, None, None)
                    self.state[p]["fragments"].append(frag)
                    bucket.fragments.append(frag)

    @torch.no_grad()
    def _init_param_state(self, param, param_group_id: int, param_id: int, dtype=None, grad_sync_dtype=None,
                          param_sync_dtype=None) -> None:
        """Split ``param`` into fragments appended to the last bucket of its dtypes (new buckets as needed)."""
        if "fragments" in self.state[param]:
            return
        dtype = self.dtype if dtype is None else dtype
        grad_sync_dtype = self.grad_sync_dtype if grad_sync_dtype is None else grad_sync_dtype
        param_sync_dtype = self.param_sync_dtype if param_sync_dtype is None else param_sync_dtype
        if dtype != self.dtype:
            raise ValueError("Optimizer states with non-default dtypes are not supported")
        if grad_sync_dtype not in zb.FLOAT_DTYPES:
            raise ValueError(f"Unsupported grad_sync_dtype={grad_sync_dtype}")
        store_params = self.store_params or param_sync_dtype != self.param_sync_dtype
        store_rem = self.store_param_remainders and param_sync_dtype == self.param_sync_dtype
        dtypes = (dtype, grad_sync_dtype, param_sync_dtype)
        buckets = self.state["buckets"]
        self.state[param]["fragments"] = frags = []

        def last_bucket_id() -> int:
            ids = [i for i, b in enumerate(buckets) if b.dtypes() == dtypes]
            return ids[-1] if ids else -1

        def make_bucket(offset: int, rest: int) -> None:
            # A bucket that would leave less than 1/16 of a bucket to spill into one more takes it all: a
            # last bucket of a few elements costs a whole collective per direction every step (2 Gloo ranks,
            # MLP 4x512, 0.7 % of the parameters past the first bucket: steps 8-14 % longer).
            shard = self.default_shard_size
            world, align = self.distributed_size, self.alignment
            need = rest + sum(_round_to_multiple(p.numel(), align) for p in self.parameters()
                              if "fragments" not in self.state.get(p, ()))
            if shard * world < need <= shard * world * 17 // 16:
                shard = _round_to_multiple(-(-need // world), align)
            buckets.append(self.StateBucket(shard * self.distributed_size, shard, dtype, self.device,
                                            grad_sync_dtype, param_sync_dtype, offset, store_params, store_rem))

        start, size = 0, param.numel()
        if last_bucket_id() < 0:
            make_bucket(max((b.contiguous_buffer_offset + b.bucket_size for b in buckets
                             if b.dtypes() == dtypes), default=0), _round_to_multiple(size, self.alignment))
        rank = self.distributed_rank
        while start < size:
            bucket_id = last_bucket_id()
            bucket = buckets[bucket_id]
            b_start = _round_to_multiple(bucket.filled_size, self.alignment)
            n = min(size - start, bucket.bucket_size - b_start)
            if n <= 0 or not bucket.able_to_fill:
                make_bucket(bucket.contiguous_buffer_offset + bucket.bucket_size,
                            _round_to_multiple(size - start, self.alignment))
                continue
            shard = bucket.shard_size
            s0 = min(max(b_start - shard * rank, 0), shard)
            s1 = min(max(b_start + n - shard * rank, 0), shard)
            local = s0 < s1
            shard_range = (s0, s1) if local else None
            sb = (s0 + shard * rank, s1 + shard * rank) if local else None
            sp = (sb[0] - b_start + start, sb[1] - b_start + start) if local else None
            frag = self.ParameterFragment(param_group_id, param_id, bucket_id, (start, start + n),
                                          (b_start, b_start + n), local, shard_range, sb, sp)
            frags.append(frag)
            bucket.fragments.append(frag)
            bucket.filled_size = b_start + n
            start += n
        if self.with_scaled_states:
            self._init_scaled_param_state(param, frags)
            frags = []
        flat = zb._flat(param)
        for frag in frags:
            if not frag.in_local_shard:
                continue
            bucket = buckets[frag.bucket_id]
            if bucket.params_shard is not None:
                bucket.params_shard[slice(*frag.shard_range)].copy_(flat[slice(*frag.shard_param_range)])
        if all("fragments" in self.state[p] for p in self.parameters()):
            used = sum(b.filled_size for b in buckets) / max(sum(b.bucket_size for b in buckets), 1)
            if used < 0.7:
                warnings.warn(f"Only {used:.1%} of buckets are used. Consider decreasing the bucket_cap_mb "
                              "argument.", stacklevel=2)

    @torch.no_grad()
    def init_param_buffer(self) -> None:
        """Make every parameter a view into one contiguous buffer per dtype triple (the all-gather then
        writes the parameters in place)."""
        self.contiguous_param_buffer = True
        self.init_params()
        sizes: dict = defaultdict(int)
        for b in self.state["buckets"]:
            sizes[b.dtypes()] = max(sizes[b.dtypes()], b.contiguous_buffer_offset + b.bucket_size)
        for key, n in sizes.items():
            if key not in self._param_buffers:
                self._param_buffers[key] = torch.zeros([n], dtype=key[2], device=self.device)
        for p in self.parameters():
            frag = self.state[p]["fragments"][0]
            b = self.state["buckets"][frag.bucket_id]
            start = b.contiguous_buffer_offset + frag.bucket_range[0]
            view = self._param_buffers[b.dtypes()][start:start + p.numel()]
            if view.dtype != p.dtype:
                if view.is_floating_point() or view.element_size() != p.element_size():
                    raise RuntimeError(f"Attempted to change a parameter with dtype={p.dtype} into a buffer view "
                                       f"with dtype={view.dtype}")
                view = view.view(p.dtype)
            if view.data_ptr() == p.data_ptr():
                continue
            view.copy_(zb._flat(p))
            p.data = view.as_strided(p.size(), p.stride())

    def grad_buffer_view(self, param: torch.nn.Parameter) -> torch.Tensor:
        """``param``'s gradient as a view into the contiguous gradient buffer (``contiguous_grad_buffer``)."""
        if not self.contiguous_grad_buffer:  # Apex asserts this
            raise AssertRuntimeError("grad_buffer_view needs contiguous_grad_buffer=True")
        if not self._grad_buffers:
            self._init_grad_buffer()
        frag = self.state[param]["fragments"][0]
        b = self.state["buckets"][frag.bucket_id]
        start = b.contiguous_buffer_offset + frag.bucket_range[0]
        flat = self._grad_buffers[b.dtypes()][start:start + param.numel()]
        return flat.detach().as_strided(param.size(), param.stride())

    def _init_grad_buffer(self) -> None:
        self.contiguous_grad_buffer = True
        self.init_params()
        sizes: dict = defaultdict(int)
        for b in self.state["buckets"]:
            sizes[b.dtypes()] = max(sizes[b.dtypes()], b.contiguous_buffer_offset + b.bucket_size)
        for key, n in sizes.items():
            self._grad_buffers[key] = torch.zeros([n], dtype=key[1], device=self.device)
