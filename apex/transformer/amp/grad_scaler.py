"""``torch.amp.GradScaler`` whose inf/NaN check is all-reduced (MAX) over the model-parallel group, so
every tensor-parallel shard and pipeline stage skips the same optimizer steps and keeps the same scale."""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex.transformer import parallel_state

_REDUCED = "_apex_model_parallel_reduced"


def _reduce_found_infs(optimizer_state: dict) -> None:
    """All-reduce this optimizer's found-inf flags in place, once per iteration."""
    if optimizer_state.get(_REDUCED):
        return
    group = parallel_state.get_model_parallel_group()
    for found_inf in optimizer_state["found_inf_per_device"].values():
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
    optimizer_state[_REDUCED] = True


class GradScaler(torch.amp.GradScaler):
    """Gradient scaler for model-parallel training (CUDA's scaler when CUDA is available, else the CPU's).

    Arguments and defaults are ``torch.cuda.amp.GradScaler``'s. An optimizer with
    ``_custom_amp_unscale_grads = True`` unscales its own gradients through ``optimizer.unscale_grads``.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                         growth_interval=growth_interval, enabled=enabled)

    def _unscale_grads_(self, optimizer, *args):
        if getattr(optimizer, "_custom_amp_unscale_grads", False):
            return optimizer.unscale_grads(*args)
        return super()._unscale_grads_(optimizer, *args)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        _reduce_found_infs(optimizer_state)
        if not sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            return optimizer.step(*args, **kwargs)
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale from the found-inf flags agreed over the model-parallel group (see
        ``torch.amp.GradScaler.update``)."""
        if self._enabled and new_scale is None:
            for state in self._per_optimizer_states.values():
                if state["found_inf_per_device"]:
                    _reduce_found_infs(state)
        super().update(new_scale)
