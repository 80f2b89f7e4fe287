"""Pipeline parallelism (Megatron's schedules): :func:`get_forward_backward_func` picks the schedule,
:func:`build_model` builds the model chunks of this stage."""

from apex.transformer.pipeline_parallel.schedules import get_forward_backward_func
from apex.transformer.pipeline_parallel.schedules.common import build_model

__all__ = ["get_forward_backward_func", "build_model"]
