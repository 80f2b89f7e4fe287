"""Apex's location of amp's loss scaler (the implementation is shared with ``apex.fp16_utils``)."""

from apex.fp16_utils._scaling import LossScaler, scale_into

__all__ = ["LossScaler", "scale_into"]
