"""Apex's multi-tensor apply: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)``."""

from apex.multi_tensor_apply.multi_tensor_apply import MultiTensorApply

multi_tensor_applier = MultiTensorApply(2048 * 32)

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
