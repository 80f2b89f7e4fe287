"""``with_scaled_states=True`` for ``DistributedFusedAdam`` (FP8-LM's per-tensor scaling): the master shard and
the moments are stored in fp16/bf16 as ``value / scale`` with one fp32 scale per (parameter, bucket)
fragment and state, chosen so the largest magnitude maps to half the dtype's maximum. The step unscales to
fp32, runs the same Adam update and rescales."""

from __future__ import annotations

import torch

from apex.contrib.optimizers import _zero_buckets as zb

_KEYS = ("param", "exp_avg", "exp_avg_sq")


class ZeroScaledStateMixin:
    @torch.no_grad()
    def _apply_state_scale(self, tensor: torch.Tensor, scale: torch.Tensor) -> None:
        """Set ``scale = absmax(tensor) / (max(dtype) / 2)`` and divide ``tensor`` by it in place."""
        if not hasattr(self, "_max_scaled_state"):
            self._max_scaled_state = torch.full([1], torch.finfo(self.dtype).max / 2, dtype=torch.float32,
                                                device=self.device)
        absmax = tensor.abs().max().to(dtype=torch.float32, device=self.device) if tensor.numel() else \
            torch.zeros([], device=self.device)
        torch.div(absmax.reshape([1]), self._max_scaled_state, out=scale)
        tensor.mul_(torch.where(scale > 0, scale.reciprocal(), 0.0))

    def _scaled_fragments(self, bucket_id: int):
        for f in self.state["buckets"][bucket_id].fragments:
            if f.in_local_shard and f.shard_range[1] > f.shard_range[0]:
                yield f, self._state_scales[(f.param_group_id, f.param_id, bucket_id)]

    @torch.no_grad()
    def _init_scaled_param_state(self, param, frags) -> None:
        flat = zb._flat(param)
        for f in frags:
            if not f.in_local_shard:
                continue
            scales = {k: torch.zeros([1], dtype=torch.float32, device=self.device) for k in _KEYS}
            self._state_scales[(f.param_group_id, f.param_id, f.bucket_id)] = scales
            temp = flat[slice(*f.shard_param_range)].to(torch.float32, copy=True)
            self._apply_state_scale(temp, scales["param"])
            self.state["buckets"][f.bucket_id].params_shard[slice(*f.shard_range)].copy_(temp)

    @torch.no_grad()
    def _unscaled_shards(self, bucket_id: int) -> list:
        """This rank's (param, exp_avg, exp_avg_sq) shards of a bucket in fp32."""
        b = self.state["buckets"][bucket_id]
        out = [torch.zeros([b.shard_size], dtype=torch.float32, device=self.device) for _ in _KEYS]
        stored = (b.params_shard, b.exp_avg_shard, b.exp_avg_sq_shard)
        for f, scales in self._scaled_fragments(bucket_id):
            r = slice(*f.shard_range)
            for o, s, k in zip(out, stored, _KEYS):
                o[r].copy_(s[r]).mul_(scales[k])
        return out

    @torch.no_grad()
    def _store_scaled(self, bucket_id: int, values: list, frags=None) -> None:
        """Scale fp32 (param, exp_avg, exp_avg_sq) shards into the bucket's storage, fragment by fragment."""
        b = self.state["buckets"][bucket_id]
        stored = (b.params_shard, b.exp_avg_shard, b.exp_avg_sq_shard)
        for f, scales in self._scaled_fragments(bucket_id):
            if frags is not None and f not in frags:
                continue
            r = slice(*f.shard_range)
            for v, s, k in zip(values, stored, _KEYS):
                temp = v[r].clone()
                self._apply_state_scale(temp, scales[k])
                s[r].copy_(temp)

    @torch.no_grad()
    def _local_step_with_scaled_states(self, bucket_ids) -> None:
        for bucket_id in bucket_ids:
            pb = self._params_buckets[bucket_id]
            grads = self._grads_buckets[bucket_id].grads_shard
            p32, m32, v32 = self._unscaled_shards(bucket_id)
            pb.params_shard = torch.empty_like(p32)
            groups: dict = {}
            for f, _ in self._scaled_fragments(bucket_id):
                r = slice(*f.shard_range)
                lists = groups.setdefault(f.param_group_id, [[] for _ in range(5)])
                for lst, t in zip(lists, (p32[r], m32[r], v32[r], grads[r], pb.params_shard[r])):
                    lst.append(t)
            for group_id, lists in groups.items():
                group = self.param_groups[group_id]
                beta1, beta2 = group["betas"]
                zb.multi_tensor_fused_adam(2048 * 32, self._dummy_overflow_buf, lists, self._grad_scale,
                                           group["lr"], beta1, beta2, group["eps"], self.state["step"],
                                           int(self.adam_w_mode), int(bool(group["bias_correction"])),
                                           group["weight_decay"])
            self._store_scaled(bucket_id, [p32, m32, v32])
            self._check_params_shard_dtypes({bucket_id: pb})
