"""``FocalLoss.apply(...)`` and ``focal_loss(cls_output, cls_targets_at_level, num_positive_sum,
num_real_classes, alpha, gamma, label_smoothing=0.0)``: targets ``−1`` background, ``−2`` ignored."""

from apex.ops.focal_loss import FocalLoss, focal_loss

__all__ = ["FocalLoss", "focal_loss"]
