"""Apex's RNN backend: ``RNNCell`` (one layer, one time step, its hidden state kept in the module),
``stackedRNN`` (layers on top of each other, looped over time) and ``bidirectionalRNN`` (a forward and a
backward stack, outputs concatenated on the feature dimension).

State: every cell keeps its hidden state between calls (Apex's design, for truncated back-propagation
through time): the first call, or a new batch size, starts from zeros; ``reset_hidden(bsz)`` zeroes it,
``detach_hidden()`` cuts the graph. Input is ``[seq, batch, features]``, or ``[batch, seq, features]`` with
``batch_first=True``.

Fixes against Apex (whose package no longer imported): ``batch_first`` is honoured (Apex ignored it);
``dropout`` is applied to the outputs of every layer but the last while training, as in ``torch.nn.LSTM``
(Apex stored it and never used it); the returned hidden states are tensors ``[layer, batch, features]``
(Apex's code documented that but returned nested lists, which made ``bidirectionalRNN`` fail); with
``reverse=True`` the final hidden state is the one after the whole (reversed) sequence, i.e. at time 0, as
``torch.nn.LSTM``'s backward direction (Apex returned the state after the first reversed step);
``bidirectionalRNN.detach_hidden`` works; a hidden state of the wrong dtype or device is re-created.
Note that Apex's bidirectional model runs two independent stacks (the backward stack's upper layers see
only backward outputs), unlike ``torch.nn.LSTM(bidirectional=True)`` for more than one layer; that
architecture is kept so that Apex checkpoints load.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def is_iterable(maybe_iterable) -> bool:
    """True if ``maybe_iterable`` is a list or a tuple (a single tensor is not)."""
    return isinstance(maybe_iterable, (list, tuple))


def flatten_list(tens_list):
    """Stack a list of equally shaped tensors on a new first dimension (a tensor is returned as is)."""
    if not is_iterable(tens_list):
        return tens_list
    return torch.stack(list(tens_list), 0)


def _check_input(input, input_size: int, batch_first: bool) -> None:
    if not isinstance(input, torch.Tensor) or input.dim() != 3:
        layout = "[batch, seq, features]" if batch_first else "[seq, batch, features]"
        raise ValueError(f"input must be a 3-D tensor {layout}, got "
                         f"{tuple(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__}")
    if not input.is_floating_point():
        raise TypeError(f"input must be a floating-point tensor, got {input.dtype}")
    if input.shape[-1] != input_size:
        raise ValueError(f"input has {input.shape[-1]} features, expected input_size={input_size}")


class _EachRNN:
    """The state methods of a model made of ``self.rnns``: each call goes to every member in turn."""

    def reset_parameters(self) -> None:
        for rnn in self.rnns:
            rnn.reset_parameters()

    def init_hidden(self, bsz: int) -> None:
        for rnn in self.rnns:
            rnn.init_hidden(bsz)

    def detach_hidden(self) -> None:
        for rnn in self.rnns:
            rnn.detach_hidden()

    def reset_hidden(self, bsz: int) -> None:
        for rnn in self.rnns:
            rnn.reset_hidden(bsz)

    def init_inference(self, bsz: int) -> None:
        for rnn in self.rnns:
            rnn.init_inference(bsz)


class bidirectionalRNN(_EachRNN, nn.Module):
    """A forward and a backward :class:`stackedRNN` over the same input; outputs and hidden states are
    concatenated on the feature dimension."""

    def __init__(self, inputRNN, num_layers: int = 1, dropout: float = 0, batch_first: bool = False):
        super().__init__()
        self.dropout = dropout
        self.batch_first = batch_first
        self.fwd = stackedRNN(inputRNN, num_layers=num_layers, dropout=dropout)
        self.bckwrd = stackedRNN(inputRNN.new_like(), num_layers=num_layers, dropout=dropout)
        self.rnns = nn.ModuleList([self.fwd, self.bckwrd])

    def forward(self, input, collect_hidden: bool = False):
        _check_input(input, self.fwd.rnns[0].input_size, self.batch_first)
        if self.batch_first:
            input = input.transpose(0, 1)
        fwd_out, fwd_hiddens = self.fwd(input, collect_hidden=collect_hidden)
        bck_out, bck_hiddens = self.bckwrd(input, reverse=True, collect_hidden=collect_hidden)
        output = torch.cat([fwd_out, bck_out], -1)
        if collect_hidden:
            hiddens = tuple([torch.cat(pair, -1) for pair in zip(f, b)] for f, b in zip(fwd_hiddens, bck_hiddens))
        else:
            hiddens = tuple(torch.cat(pair, -1) for pair in zip(fwd_hiddens, bck_hiddens))
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, hiddens


class stackedRNN(_EachRNN, nn.Module):
    """``num_layers`` cells on top of each other (layer ``i+1`` reads layer ``i``'s output), run over time.

    ``forward(input, collect_hidden=False, reverse=False)`` returns ``(output, hidden_states)``: ``output``
    is the top layer's output at every step (``[seq, batch, output_size]``, or batch first); without
    ``collect_hidden``, ``hidden_states`` lists each hidden state (``h``, and ``c`` for LSTMs) after the last
    step as ``[layer, batch, features]``; with it, each hidden state at every step (a list over time of
    ``[layer, batch, features]`` tensors).
    """

    def __init__(self, inputRNN, num_layers: int = 1, dropout: float = 0, batch_first: bool = False):
        super().__init__()
        if not (isinstance(dropout, (int, float)) and 0 <= dropout <= 1):
            raise ValueError(f"dropout must be a number in [0, 1], got {dropout!r}")
        self.dropout = dropout
        self.batch_first = batch_first
        if isinstance(inputRNN, RNNCell):
            if not isinstance(num_layers, int) or num_layers < 1:
                raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
            rnns = [inputRNN] + [inputRNN.new_like(inputRNN.output_size) for _ in range(num_layers - 1)]
        elif isinstance(inputRNN, list):
            if len(inputRNN) != num_layers:
                raise ValueError(f"a list of {len(inputRNN)} cells was given for num_layers={num_layers}")
            rnns = inputRNN
        else:
            raise TypeError(f"inputRNN must be an RNNCell or a list of them, got {type(inputRNN).__name__}")
        self.nLayers = len(rnns)
        self.rnns = nn.ModuleList(rnns)

    def forward(self, input, collect_hidden: bool = False, reverse: bool = False):
        _check_input(input, self.rnns[0].input_size, self.batch_first)
        if self.batch_first:
            input = input.transpose(0, 1)
        seq_len = input.size(0)
        steps = range(seq_len - 1, -1, -1) if reverse else range(seq_len)
        drop = self.training and self.dropout > 0
        outputs, per_step = [], []
        for seq in steps:
            prev_out = input[seq]
            states = []
            for layer, rnn in enumerate(self.rnns):
                if layer > 0 and drop:
                    prev_out = F.dropout(prev_out, self.dropout, True)
                outs = rnn(prev_out)
                states.append(outs)
                prev_out = outs[0]
            outputs.append(prev_out)
            if collect_hidden:
                per_step.append(states)
        if reverse:
            outputs.reverse()
            per_step.reverse()
        output = torch.stack(outputs, 0) if outputs else input.new_empty(0, input.size(1), self.rnns[-1].output_size)
        n_hid = self.rnns[0].n_hidden_states
        if collect_hidden:
            hidden = [[torch.stack([s[k][i] for k in range(self.nLayers)]) for s in per_step] for i in range(n_hid)]
        else:
            hidden = [torch.stack([rnn.hidden[i] for rnn in self.rnns]) if seq_len else None
                      for i in range(n_hid)]
        if self.batch_first:
            output = output.transpose(0, 1)
        return output, hidden


class RNNCell(nn.Module):
    """One recurrent layer for one time step: ``cell(input, hidden, w_ih, w_hh, b_ih, b_hh)``.

    ``gate_multiplier`` is 4 for LSTM-like cells, 3 for GRU-like and 1 for plain RNNs; ``w_ih`` is
    ``[gate_multiplier·hidden_size, input_size]`` and ``w_hh`` ``[gate_multiplier·hidden_size, output_size]``
    (gates in PyTorch's order: i, f, g, o for LSTMs; r, z, n for GRUs). With ``output_size != hidden_size``
    the output ``h`` is projected by ``w_ho`` (``[output_size, hidden_size]``, as ``torch.nn.LSTM``'s
    ``proj_size``). Parameters are initialised ``U(−1/√hidden_size, 1/√hidden_size)``.
    """

    def __init__(self, gate_multiplier: int, input_size: int, hidden_size: int, cell, n_hidden_states: int = 2,
                 bias: bool = False, output_size: int | None = None):
        super().__init__()
        for name, value in (("input_size", input_size), ("hidden_size", hidden_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if output_size is not None and (not isinstance(output_size, int) or output_size < 1):
            raise ValueError(f"output_size must be None or a positive int, got {output_size!r}")
        self.gate_multiplier = gate_multiplier
        self.input_size = input_size
        self.hidden_size = hidden_size
        self.cell = cell
        self.bias = bias
        self.output_size = hidden_size if output_size is None else output_size
        self.gate_size = gate_multiplier * hidden_size
        self.n_hidden_states = n_hidden_states
        self.w_ih = nn.Parameter(torch.empty(self.gate_size, input_size))
        self.w_hh = nn.Parameter(torch.empty(self.gate_size, self.output_size))
        if self.output_size != hidden_size:
            self.w_ho = nn.Parameter(torch.empty(self.output_size, hidden_size))
        self.b_ih = self.b_hh = None
        if bias:
            self.b_ih = nn.Parameter(torch.empty(self.gate_size))
            self.b_hh = nn.Parameter(torch.empty(self.gate_size))
        self.hidden = [None] * n_hidden_states
        self.reset_parameters()

    def new_like(self, new_input_size: int | None = None) -> RNNCell:
        return type(self)(self.gate_multiplier, self.input_size if new_input_size is None else new_input_size,
                          self.hidden_size, self.cell, self.n_hidden_states, self.bias, self.output_size)

    def reset_parameters(self, gain: float = 1) -> None:
        stdev = 1.0 / math.sqrt(self.hidden_size)
        with torch.no_grad():
            for param in self.parameters():
                param.uniform_(-stdev, stdev)

    def init_hidden(self, bsz: int) -> None:
        """Zero hidden states for batch size ``bsz`` where none exist (or their size, dtype or device differ)."""
        ref = next(self.parameters())
        for i, h in enumerate(self.hidden):
            if h is None or h.size(0) != bsz or h.dtype != ref.dtype or h.device != ref.device:
                size = self.output_size if i == 0 else self.hidden_size
                self.hidden[i] = ref.new_zeros(bsz, size)

    def reset_hidden(self, bsz: int) -> None:
        self.hidden = [None] * self.n_hidden_states
        self.init_hidden(bsz)

    def init_inference(self, bsz: int) -> None:
        # Apex's cells declare this hook; starting inference is starting from zero states.
        self.reset_hidden(bsz)

    def detach_hidden(self) -> None:
        if any(h is None for h in self.hidden):
            raise RuntimeError("Must initialize hidden state before you can detach it")
        self.hidden = [h.detach() for h in self.hidden]

    def _project(self, hidden: list) -> tuple:
        if self.output_size != self.hidden_size:
            hidden[0] = F.linear(hidden[0], self.w_ho)
        self.hidden = hidden
        return tuple(hidden)

    def forward(self, input):
        """One time step on ``input`` ``[batch, input_size]``; returns the new hidden states."""
        self.init_hidden(input.size(0))
        state = self.hidden[0] if self.n_hidden_states == 1 else tuple(self.hidden)
        out = self.cell(input, state, self.w_ih, self.w_hh, b_ih=self.b_ih, b_hh=self.b_hh)
        return self._project(list(out) if self.n_hidden_states > 1 else [out])
