"""Gradient norm, clipping and loss-scale unscaling of ``DistributedFusedAdam``: all deferred into one
gradient scale that the sharded Adam step multiplies the gradients by."""

from __future__ import annotations

import torch

from apex._errors import AssertValueError
from apex.contrib.optimizers._gloo_collectives import all_reduce


class ZeroNormMixin:
    @torch.no_grad()
    def _local_grad_norm(self, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """Squared 2-norm of this rank's shard of the (reduced) gradients."""
        self.grad_sync()
        shards = []
        if parameters is None:
            shards = [gb.grads_shard for gb in self._grads_buckets.values() if gb.grads_shard is not None]
        else:
            known = {self.parameter(f) for b in self.state["buckets"] for f in b.fragments}
            for p in parameters:
                if p not in known:
                    raise RuntimeError("Attempted to compute gradient norm for a parameter that is not managed "
                                       "by DistributedFusedAdam")
                for f in self.state[p]["fragments"]:
                    if f.in_local_shard:
                        shards.append(self._grads_buckets[f.bucket_id].grads_shard[slice(*f.shard_range)])
        total = torch.zeros([], dtype=torch.float32, device=self.device)
        for s in shards:
            total += s.float().square().sum()
        return total

    def grad_norm(self, parameters=None, norm_type: float = 2.0, force: bool = False) -> torch.Tensor:
        """2-norm of all gradients (as one vector), times the pending gradient scale; cached until the
        gradients change."""
        if float(norm_type) != 2.0:  # Apex asserts this
            raise AssertValueError(f"only norm_type=2 is supported, got {norm_type}")
        if force or self._grad_norm is None:
            sq = self._local_grad_norm(parameters=parameters)
            all_reduce(sq, group=self.distributed_process_group)
            self._grad_norm = sq.sqrt()
        return (self._grad_norm * self._grad_scale).detach()

    def clip_grad_norm(self, max_norm: float, parameters=None, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients (at the next step) so their norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_``: ``coef = min(max_norm / (norm + 1e-6), 1)``. Returns the norm."""
        if not max_norm > 0:  # Apex asserts this
            raise AssertValueError(f"max_norm must be > 0, got {max_norm}")
        total = self.grad_norm(parameters=parameters, norm_type=norm_type)
        self._grad_scale *= torch.clamp(max_norm / (total + 1e-6), max=1.0)
        return total

    @torch.no_grad()
    def unscale_grads(self, *args, inv_scale: torch.Tensor | None = None, grad_scaler=None) -> dict:
        """Multiply the pending gradient scale by ``inv_scale`` (or the ``GradScaler``'s ``1/scale``) and
        report non-finite gradients (``{device: found_inf}``)."""
        from torch.amp.grad_scaler import OptState

        if inv_scale is None and args:
            inv_scale = args[0]
        found = {self.device: torch.logical_not(torch.isfinite(self.grad_norm())).float().reshape([1])}
        if grad_scaler is not None and grad_scaler._enabled:
            st = grad_scaler._per_optimizer_states[id(self)]
            if st["stage"] is OptState.UNSCALED:
                raise RuntimeError("unscale_grads has already been called since the last GradScaler update")
            if st["stage"] is OptState.STEPPED:
                raise RuntimeError("unscale_grads is being called after optimizer step")
            if inv_scale is not None:
                raise ValueError("unscale_grads is being called with both inv_scale and grad_scaler")
            inv_scale = grad_scaler._scale.double().reciprocal().to(dtype=torch.float32, device=self.device)
            st["found_inf_per_device"] = found
            st["stage"] = OptState.UNSCALED
        if inv_scale is None:
            raise ValueError("unscale_grads is being called with neither inv_scale nor grad_scaler")
        self._grad_scale *= torch.as_tensor(inv_scale, dtype=torch.float32, device=self.device).reshape([])
        return found

