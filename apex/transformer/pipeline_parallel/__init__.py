from apex.transformer.pipeline_parallel.schedules import get_forward_backward_func
from apex.transformer.pipeline_parallel.schedules.common import build_model

__all__ = ["get_forward_backward_func", "build_model"]
