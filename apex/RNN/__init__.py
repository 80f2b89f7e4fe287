"""``apex.RNN``: Apex's stateful stacked RNNs (LSTM, GRU, ReLU, Tanh and multiplicative LSTM), working again.

Apex's package imported ``torch.nn._functions.rnn``, gone from PyTorch for years; this one runs the cells on
PyTorch's own fused cell operators (``torch.lstm_cell``, ``torch.gru_cell``, ``torch.rnn_tanh_cell``,
``torch.rnn_relu_cell``), whose gate layouts are Apex's. See :mod:`apex.RNN.RNNBackend` for the fixes.
"""

from apex.RNN.models import GRU, LSTM, ReLU, Tanh, mLSTM, toRNNBackend
from apex.RNN.RNNBackend import RNNCell, bidirectionalRNN, stackedRNN

__all__ = ["GRU", "LSTM", "RNNCell", "ReLU", "Tanh", "bidirectionalRNN", "mLSTM", "stackedRNN", "toRNNBackend",
           "models"]
