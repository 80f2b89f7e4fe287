"""Checkpoints of ``DistributedFusedAdam`` in Apex's two layouts.

Format 2 (default): every rank returns the whole state, gathered bucket by bucket: ``{"state": {"step": s,
i: {"param", "exp_avg", "exp_avg_sq"}}, "param_groups": [...], "format": 2}`` with one CPU tensor of the
parameter's shape per entry (``param`` is the fp32 master: the stored shard, the bf16 parameter plus its
remainder, or the parameter itself). It loads into any world size and bucket size.

Format 1: each rank's own shards (its ``StateBucket`` objects and fragments); with ``gather_on_root`` the
ranks' pickled states are gathered on the root as ``{"gathered_states": [uint8 tensors]}``. It loads only
into the same distributed size.
"""

from __future__ import annotations

import copy
import io
import warnings

import torch
import torch.distributed as dist

from apex.contrib.optimizers import _zero_buckets as zb
from apex.contrib.optimizers._zero_comm import _all_gather

_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


class ZeroStateDictMixin:
    def state_dict(self, *, state_dict_format: int | None = None, gather_on_root: bool | None = None) -> dict | None:
        """The optimizer state (format 2 by default, on every rank; every rank must call it)."""
        fmt = 2 if state_dict_format is None else state_dict_format
        if fmt == 1:
            sd = self._state_dict_v1(True if gather_on_root is None else bool(gather_on_root))
        elif fmt == 2:
            sd = self._state_dict_v2()
        else:
            raise ValueError(f"Unrecognized state dict format ({state_dict_format})")
        if sd is not None:
            sd["format"] = fmt
        return sd

    def _packed_groups(self) -> list:
        groups, index = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        return groups

    @torch.no_grad()
    def _local_param_shard(self, bucket) -> torch.Tensor:
        """This rank's shard of the fp32 (``dtype``) master parameters of ``bucket``."""
        if bucket.params_shard is not None:
            return bucket.params_shard.to(self.dtype, copy=True)
        out = torch.zeros([bucket.shard_size], dtype=self.dtype, device=self.device)
        for f in bucket.fragments:
            if not f.in_local_shard or f.shard_range[1] <= f.shard_range[0]:
                continue
            model = zb._flat(self.parameter(f))[slice(*f.shard_param_range)]
            r = slice(*f.shard_range)
            if bucket.param_remainders_shard is not None:
                zb._bf16_rem_to_fp32(model.contiguous(), bucket.param_remainders_shard[r], out[r])
            else:
                out[r].copy_(model)
        return out

    @torch.no_grad()
    def _state_dict_v2(self) -> dict:
        self.init_params()
        self.grad_sync()
        self.param_sync()
        index = {p: i for i, p in enumerate(self.parameters())}
        step = self.state["step"]
        state: dict = {"step": step.clone() if isinstance(step, torch.Tensor) else step}
        dtype = torch.float32 if self.with_scaled_states else self.dtype
        for p, i in index.items():
            state[i] = {k: torch.zeros_like(p, dtype=dtype, device="cpu") for k in _STATE_KEYS}
        for bucket_id, bucket in enumerate(self.state["buckets"]):
            if self.with_scaled_states:
                local = torch.stack(self._unscaled_shards(bucket_id)).reshape(-1)
            else:
                local = torch.stack([self._local_param_shard(bucket), bucket.exp_avg_shard.to(dtype),
                                     bucket.exp_avg_sq_shard.to(dtype)]).reshape(-1)
            if self.distributed_size > 1:
                gathered = torch.empty([local.numel() * self.distributed_size], dtype=local.dtype,
                                       device=self.device)
                _all_gather(gathered, local, group=self.distributed_process_group)
            else:
                gathered = local
            full = gathered.view(self.distributed_size, 3, bucket.shard_size).transpose(0, 1).reshape(3, -1).cpu()
            for f in bucket.fragments:
                if f.param_range[1] <= f.param_range[0]:
                    continue
                entry = state[index[self.parameter(f)]]
                for k, key in enumerate(_STATE_KEYS):
                    zb._flat(entry[key])[slice(*f.param_range)].copy_(full[k, slice(*f.bucket_range)])
        return {"state": state, "param_groups": self._packed_groups()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint of either format (format 2 from any world size)."""
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
        state_dict = dict(state_dict)
        fmt = state_dict.pop("format", None)
        if fmt is None:
            fmt = 1 if ("buckets" in state_dict.get("state", {}) or "gathered_states" in state_dict) else 2
        if fmt == 1:
            self._load_state_dict_v1(state_dict)
        elif fmt == 2:
            self._load_state_dict_v2(state_dict)
        else:
            raise ValueError(f"Unrecognized state dict format ({fmt})")

    def _check_groups(self, saved_groups) -> None:
        if not isinstance(saved_groups, list) or len(saved_groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, s in zip(self.param_groups, saved_groups):
            if len(s["params"]) != len(g["params"]):
                raise ValueError("loaded state dict contains a parameter group that doesn't match the size of "
                                 "optimizer's group")

    def _load_groups(self, saved_groups) -> None:
        for g, s in zip(self.param_groups, saved_groups):
            for k, v in s.items():
                if k != "params":
                    g[k] = v
            if self.capturable:
                g["lr"] = torch.as_tensor(g["lr"], dtype=torch.float32).to(self.device)

    @torch.no_grad()
    def _load_state_dict_v2(self, state_dict: dict) -> None:
        self.init_params()
        self.grad_sync()
        self.param_sync()
        groups, saved = state_dict.get("param_groups"), state_dict.get("state")
        if groups is None or saved is None or "step" not in saved:
            raise ValueError("state dict needs 'state' (with 'step') and 'param_groups'")
        self._check_groups(groups)
        entries = {}
        for g, s in zip(self.param_groups, groups):
            for p, i in zip(g["params"], s["params"]):
                e = saved.get(i)
                if not isinstance(e, dict) or any(k not in e for k in _STATE_KEYS):
                    raise ValueError(f"state dict has no param/exp_avg/exp_avg_sq for parameter {i}")
                for k in _STATE_KEYS:
                    if not isinstance(e[k], torch.Tensor) or e[k].numel() != p.numel():
                        raise ValueError(f"state dict entry {i}[{k!r}] does not have the parameter's "
                                         f"{p.numel()} elements")
                entries[p] = e
        self._load_groups(groups)
        step = saved["step"]
        self.state["step"] = (torch.as_tensor(step, dtype=torch.int32).reshape([1]).to(self.device)
                              if self.capturable else int(step))
        for p, e in entries.items():
            flat = {k: zb._flat(e[k]) for k in _STATE_KEYS}
            for f in self.state[p]["fragments"]:
                if not f.in_local_shard or f.shard_range[1] <= f.shard_range[0]:
                    continue
                b = self.state["buckets"][f.bucket_id]
                pr, sr = slice(*f.shard_param_range), slice(*f.shard_range)
                if self.with_scaled_states:
                    scales = self._state_scales[(f.param_group_id, f.param_id, f.bucket_id)]
                    for key, dst in zip(_STATE_KEYS, (b.params_shard, b.exp_avg_shard, b.exp_avg_sq_shard)):
                        temp = flat[key][pr].to(device=self.device, dtype=torch.float32, copy=True)
                        self._apply_state_scale(temp, scales[key])
                        dst[sr].copy_(temp)
                    continue
                if b.params_shard is not None:
                    b.params_shard[sr].copy_(flat["param"][pr])
                if b.param_remainders_shard is not None:
                    bits = flat["param"][pr].to(torch.float32).contiguous().view(torch.int32)
                    b.param_remainders_shard[sr].copy_((bits & 0xFFFF).to(torch.int16))
                b.exp_avg_shard[sr].copy_(flat["exp_avg"][pr])
                b.exp_avg_sq_shard[sr].copy_(flat["exp_avg_sq"][pr])

    # -- format 1 --------------------------------------------------------------------------------------------

    def _local_state_v1(self) -> dict:
        index = {p: i for i, p in enumerate(self.parameters())}
        state = {"step": self.state["step"], "buckets": [self._own_storage_bucket(b) for b in self.state["buckets"]]}
        for p, i in index.items():
            if "fragments" in self.state[p]:
                state[i] = {"fragments": self.state[p]["fragments"]}
        return {"state": state, "param_groups": self._packed_groups(), "distributed_size": self.distributed_size}

    @staticmethod
    def _own_storage_bucket(b: zb.StateBucket) -> zb.StateBucket:
        """``b`` itself, or a shallow copy whose master shard has its own storage when the live one is a view
        of the all-gather buffer (``_alias_master_shard``): pickling a view saves its whole storage."""
        t = b.params_shard
        if t is None or t.untyped_storage().nbytes() == t.numel() * t.element_size():
            return b
        b = copy.copy(b)
        b.params_shard = t.clone()
        return b

    def _state_dict_v1(self, gather_on_root: bool) -> dict | None:
        if self.with_scaled_states:
            raise NotImplementedError("Deprecated v1 format does not support scaled state")
        warnings.warn("Making optimizer state dictionary in deprecated v1 format. Future support is not "
                      "guaranteed.", stacklevel=2)
        self.init_params()
        self.grad_sync()
        self.param_sync()
        local = self._local_state_v1()
        if not gather_on_root:
            return local
        buf = io.BytesIO()
        torch.save(local, buf)
        mine = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        gathered = [None] * self.distributed_size if self.distributed_rank == 0 else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(self.distributed_process_group, 0)
                           if self.distributed_process_group is not dist.group.WORLD else 0,
                           group=self.distributed_process_group)
        return {"gathered_states": gathered} if self.distributed_rank == 0 else None

    def _load_state_dict_v1(self, state_dict: dict) -> None:
        if self.with_scaled_states:
            raise NotImplementedError("Deprecated v1 format does not support scaled state")
        warnings.warn("Loading checkpoint in deprecated v1 format. Future support is not guaranteed.", stacklevel=2)
        if "gathered_states" in state_dict:
            states = state_dict["gathered_states"]
            if len(states) != self.distributed_size:
                raise ValueError(f"format-1 checkpoint was saved by {len(states)} ranks, this optimizer has "
                                 f"{self.distributed_size}; save it with state_dict() (format 2) to re-shard")
            state_dict = torch.load(io.BytesIO(states[self.distributed_rank].numpy().tobytes()),
                                    weights_only=False, map_location="cpu")
        saved = state_dict["state"]
        size = state_dict.get("distributed_size", self.distributed_size)
        if size != self.distributed_size or any(b.shard_size * self.distributed_size != b.bucket_size
                                                for b in saved["buckets"]):
            raise ValueError("format-1 checkpoint was saved with a different distributed size; use format 2")
        self._check_groups(state_dict["param_groups"])
        self._load_groups(state_dict["param_groups"])
        for b in saved["buckets"]:
            for name in ("params_shard", "param_remainders_shard", "exp_avg_shard", "exp_avg_sq_shard"):
                t = getattr(b, name)
                if t is not None:
                    setattr(b, name, t.to(self.device))
        params = list(self.parameters())
        for p in params:
            self.state[p].pop("fragments", None)
        for i, p in enumerate(params):
            if i in saved:
                self.state[p]["fragments"] = saved[i]["fragments"]
        self.state["buckets"] = saved["buckets"]
        self._buckets_shrunk = True
        step = saved["step"]
        self.state["step"] = step.to(self.device) if isinstance(step, torch.Tensor) else step
        self._grads_buckets.clear()
        self._params_buckets.clear()
        self._comm_buffers.clear()
        self._grad_views.clear()
        self._deferred_plans.clear()
        self._param_copy_cache.clear()
