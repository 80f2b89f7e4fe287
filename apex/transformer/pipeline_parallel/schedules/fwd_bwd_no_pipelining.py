"""Gradient accumulation over microbatches on one stage (no inter-stage communication)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from apex.transformer.pipeline_parallel.schedules.common import Batch, FwdStepFunc, backward_step, forward_step
from apex.transformer.pipeline_parallel.utils import (
    get_kth_microbatch,
    get_model_type,
    get_num_microbatches,
    listify_model,
)

__all__ = ["forward_backward_no_pipelining"]


def forward_backward_no_pipelining(
    forward_step_func: FwdStepFunc,
    batch: Batch,
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    forward_only: bool,
    dtype: torch.dtype | None = None,
    grad_scaler: Any | None = None,
    disable_autocast: bool = False,
    custom_sync_context_handler=None,
    **kwargs,
) -> list[Any]:
    """Forward (and unless ``forward_only`` backward) each of ``get_num_microbatches()`` microbatches.

    Gradient synchronisation (DDP's ``no_sync`` or ``custom_sync_context_handler``) is disabled for all but
    the last microbatch. ``tensor_shape`` etc. in ``kwargs`` are accepted and ignored. Returns the list of
    ``loss_reduced`` values.
    """
    model = listify_model(model)
    if len(model) != 1:
        raise RuntimeError(f"`model` is expected be a `nn.Module`, but got a list of {len(model)} modules")
    model = model[0]
    model_type = get_model_type(model)
    if custom_sync_context_handler is not None:
        context_handler = custom_sync_context_handler
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        context_handler = model.no_sync
    else:
        context_handler = contextlib.nullcontext
    losses_reduced: list[Any] = []
    num_micro_batches = get_num_microbatches()

    def one(k: int) -> None:
        out = forward_step(forward_step_func, get_kth_microbatch(batch, k), model, None, losses_reduced,
                           dtype=dtype, disable_autocast=disable_autocast)
        if not forward_only:
            backward_step(None, out, None, model_type=model_type, grad_scaler=grad_scaler)

    with context_handler():
        for k in range(num_micro_batches - 1):
            one(k)
    one(num_micro_batches - 1)
    return losses_reduced
