"""``SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False)``:
per-row ``(1−ε)·nll + ε·mean(−log p)``, zero on rows labelled ``padding_idx``. A sixth argument,
``inplace_backward=True``, writes the logits' gradient over the logits (see ``apex.ops.xentropy``)."""

from apex.ops.xentropy import SoftmaxCrossEntropyLoss, softmax_cross_entropy

__all__ = ["SoftmaxCrossEntropyLoss", "softmax_cross_entropy"]
