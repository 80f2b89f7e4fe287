"""Apex's RNN constructors: each returns a :class:`stackedRNN`, or a :class:`bidirectionalRNN` with
``bidirectional=True``, of the matching cell."""

from __future__ import annotations

from apex.RNN.cells import GRUCell, LSTMCell, RNNReLUCell, RNNTanhCell, mLSTMRNNCell
from apex.RNN.RNNBackend import RNNCell, bidirectionalRNN, stackedRNN


def toRNNBackend(inputRNN, num_layers: int, bidirectional: bool = False, dropout: float = 0,
                 batch_first: bool = False):
    """Wrap a cell in ``num_layers`` stacked layers (two stacks when ``bidirectional``)."""
    if bidirectional:
        return bidirectionalRNN(inputRNN, num_layers, dropout=dropout, batch_first=batch_first)
    return stackedRNN(inputRNN, num_layers, dropout=dropout, batch_first=batch_first)


def LSTM(input_size, hidden_size, num_layers, bias=True, batch_first=False, dropout=0, bidirectional=False,
         output_size=None):
    """LSTM (gates i, f, g, o as ``torch.nn.LSTM``; ``output_size`` projects ``h`` like its ``proj_size``)."""
    cell = RNNCell(4, input_size, hidden_size, LSTMCell, 2, bias, output_size)
    return toRNNBackend(cell, num_layers, bidirectional, dropout=dropout, batch_first=batch_first)


def GRU(input_size, hidden_size, num_layers, bias=True, batch_first=False, dropout=0, bidirectional=False,
        output_size=None):
    """GRU (gates r, z, n as ``torch.nn.GRU``). ``output_size`` must equal ``hidden_size``: a GRU's output is
    its hidden state."""
    if output_size is not None and output_size != hidden_size:
        raise ValueError(f"output_size must be None or equal hidden_size ({hidden_size}) for a GRU, "
                         f"got {output_size!r}")
    cell = RNNCell(3, input_size, hidden_size, GRUCell, 1, bias, output_size)
    return toRNNBackend(cell, num_layers, bidirectional, dropout=dropout, batch_first=batch_first)


def ReLU(input_size, hidden_size, num_layers, bias=True, batch_first=False, dropout=0, bidirectional=False,
         output_size=None):
    """Elman RNN with ReLU: ``h' = relu(x W_ihᵀ + b_ih + h W_hhᵀ + b_hh)``."""
    cell = RNNCell(1, input_size, hidden_size, RNNReLUCell, 1, bias, output_size)
    return toRNNBackend(cell, num_layers, bidirectional, dropout=dropout, batch_first=batch_first)


def Tanh(input_size, hidden_size, num_layers, bias=True, batch_first=False, dropout=0, bidirectional=False,
         output_size=None):
    """Elman RNN with tanh."""
    cell = RNNCell(1, input_size, hidden_size, RNNTanhCell, 1, bias, output_size)
    return toRNNBackend(cell, num_layers, bidirectional, dropout=dropout, batch_first=batch_first)


def mLSTM(input_size, hidden_size, num_layers, bias=True, batch_first=False, dropout=0, bidirectional=False,
          output_size=None):
    """Multiplicative LSTM (Krause et al.); see :func:`apex.RNN.cells.mLSTMCell`."""
    cell = mLSTMRNNCell(input_size, hidden_size, bias=bias, output_size=output_size)
    return toRNNBackend(cell, num_layers, bidirectional, dropout=dropout, batch_first=batch_first)
