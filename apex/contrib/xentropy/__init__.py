"""Apex's ``apex.contrib.xentropy``: softmax cross entropy with label smoothing (see ``apex.ops.xentropy``)."""

from apex.contrib.xentropy.softmax_xentropy import SoftmaxCrossEntropyLoss

__all__ = ["SoftmaxCrossEntropyLoss"]
