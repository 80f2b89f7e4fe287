"""Apex's ``apex.contrib.focal_loss``: the fused sigmoid focal loss (see ``apex.ops.focal_loss``)."""

from apex.contrib.focal_loss import focal_loss

__all__ = ["focal_loss"]
