"""Cell functions (``cell(input, hidden, w_ih, w_hh, b_ih=None, b_hh=None)``) on PyTorch's fused cell ops, and
Apex's multiplicative LSTM (``mLSTMRNNCell``, ``mLSTMCell``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from apex.RNN.RNNBackend import RNNCell


def LSTMCell(input, hidden, w_ih, w_hh, b_ih=None, b_hh=None):
    """``gates = x W_ihᵀ + b_ih + h W_hhᵀ + b_hh`` split (i, f, g, o); ``c' = σ(f)c + σ(i)tanh(g)``,
    ``h' = σ(o)tanh(c')``. Returns ``(h', c')``."""
    hx, cx = hidden
    if hx.size(-1) == cx.size(-1):
        return torch.lstm_cell(input, (hx, cx), w_ih, w_hh, b_ih, b_hh)
    # A projected h (output_size != hidden_size): PyTorch's cell op infers the hidden size from h.
    gates = F.linear(input, w_ih, b_ih) + F.linear(hx, w_hh, b_hh)
    i, f, g, o = gates.chunk(4, -1)
    cy = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(cy), cy


def GRUCell(input, hidden, w_ih, w_hh, b_ih=None, b_hh=None):
    """Gates (r, z, n): ``n = tanh(x_n + r·h_n)``, ``h' = n + z·(h − n)``."""
    return torch.gru_cell(input, hidden, w_ih, w_hh, b_ih, b_hh)


def RNNReLUCell(input, hidden, w_ih, w_hh, b_ih=None, b_hh=None):
    """One Elman RNN step, ``h' = relu(x W_ihᵀ + b_ih + h W_hhᵀ + b_hh)``, on ``torch.rnn_relu_cell``."""
    return torch.rnn_relu_cell(input, hidden, w_ih, w_hh, b_ih, b_hh)


def RNNTanhCell(input, hidden, w_ih, w_hh, b_ih=None, b_hh=None):
    """One Elman RNN step, ``h' = tanh(x W_ihᵀ + b_ih + h W_hhᵀ + b_hh)``, on ``torch.rnn_tanh_cell``."""
    return torch.rnn_tanh_cell(input, hidden, w_ih, w_hh, b_ih, b_hh)


def mLSTMCell(input, hidden, w_ih, w_hh, w_mih, w_mhh, b_ih=None, b_hh=None):
    """Multiplicative LSTM: ``m = (x W_mihᵀ) ⊙ (h W_mhhᵀ)``, then an LSTM step whose recurrent input is ``m``:
    ``gates = x W_ihᵀ + b_ih + m W_hhᵀ + b_hh``. Returns ``(h', c')``."""
    hx, cx = hidden
    m = F.linear(input, w_mih) * F.linear(hx, w_mhh)
    return LSTMCell(input, (m, cx), w_ih, w_hh, b_ih, b_hh)


class mLSTMRNNCell(RNNCell):
    """An :class:`RNNCell` running :func:`mLSTMCell`, with the extra weights ``w_mih``
    (``[output_size, input_size]``) and ``w_mhh`` (``[output_size, output_size]``)."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = False, output_size: int | None = None):
        super().__init__(4, input_size, hidden_size, mLSTMCell, n_hidden_states=2, bias=bias,
                         output_size=output_size)
        self.w_mih = nn.Parameter(torch.empty(self.output_size, self.input_size))
        self.w_mhh = nn.Parameter(torch.empty(self.output_size, self.output_size))
        self.reset_parameters()

    def forward(self, input):
        self.init_hidden(input.size(0))
        out = self.cell(input, tuple(self.hidden), self.w_ih, self.w_hh, self.w_mih, self.w_mhh,
                        b_ih=self.b_ih, b_hh=self.b_hh)
        return self._project(list(out))

    def new_like(self, new_input_size: int | None = None) -> mLSTMRNNCell:
        return type(self)(self.input_size if new_input_size is None else new_input_size, self.hidden_size,
                          self.bias, self.output_size)
