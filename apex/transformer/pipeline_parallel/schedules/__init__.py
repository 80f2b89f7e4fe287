"""Pipeline schedules and the selector Megatron/NeMo call."""

from __future__ import annotations

from collections.abc import Callable

from apex.transformer import parallel_state
from apex.transformer.pipeline_parallel.schedules.fwd_bwd_no_pipelining import forward_backward_no_pipelining
from apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_with_interleaving import (
    _forward_backward_pipelining_with_interleaving,
)
from apex.transformer.pipeline_parallel.schedules.fwd_bwd_pipelining_without_interleaving import (
    forward_backward_pipelining_without_interleaving,
)
from apex.transformer.pipeline_parallel.utils import get_num_microbatches

__all__ = ["get_forward_backward_func"]


class ExperimentalWarning(Warning):
    """Apex's warning category for experimental pipeline features (defined here, as in Apex)."""


def get_forward_backward_func(
    virtual_pipeline_model_parallel_size: int | None, pipeline_model_parallel_size: int
) -> Callable:
    """No pipelining for one stage, the interleaved schedule with virtual stages, else 1F1B.

    The interleaved schedule needs the number of microbatches divisible by ``pipeline_model_parallel_size``.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() <= 1:
        return forward_backward_no_pipelining
    if virtual_pipeline_model_parallel_size is None:
        return forward_backward_pipelining_without_interleaving
    num_microbatches = get_num_microbatches()
    if num_microbatches % pipeline_model_parallel_size != 0:
        raise RuntimeError(
            f"number of microbatches ({num_microbatches}) is not divisible by pipeline-parallel size "
            f"({pipeline_model_parallel_size}) when using interleaved schedule"
        )
    return _forward_backward_pipelining_with_interleaving
