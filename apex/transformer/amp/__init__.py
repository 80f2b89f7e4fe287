"""Mixed precision for model-parallel training: a GradScaler that agrees across the model-parallel group."""

from apex.transformer.amp.grad_scaler import GradScaler

__all__ = ["GradScaler"]
