"""Apex's ``apex.contrib.transducer``: the RNN-T joint and loss (see :mod:`apex.ops.transducer_joint` and
:mod:`apex.ops.transducer_loss` for the math and dtype policy)."""

from apex.contrib.transducer import _transducer_ref
from apex.contrib.transducer.transducer import TransducerJoint, TransducerLoss

__all__ = ["TransducerJoint", "TransducerLoss", "_transducer_ref"]
