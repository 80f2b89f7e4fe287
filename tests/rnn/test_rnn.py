"""apex.RNN against torch.nn.LSTM/GRU/RNN with the same weights, and mLSTM against its formula in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from apex import RNN
from apex.testing import assert_rel_close


def _copy_layer(cell, ref, layer, suffix=""):
    """Copy torch.nn.<RNN> layer weights into an apex RNNCell (same gate layout)."""
    with torch.no_grad():
        cell.w_ih.copy_(getattr(ref, f"weight_ih_l{layer}{suffix}"))
        cell.w_hh.copy_(getattr(ref, f"weight_hh_l{layer}{suffix}"))
        if cell.bias:
            cell.b_ih.copy_(getattr(ref, f"bias_ih_l{layer}{suffix}"))
            cell.b_hh.copy_(getattr(ref, f"bias_hh_l{layer}{suffix}"))
        if cell.output_size != cell.hidden_size:
            cell.w_ho.copy_(getattr(ref, f"weight_hr_l{layer}{suffix}"))


def _grads(out, params, seed=1):
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return torch.autograd.grad(out, params, dy)


KINDS = {"LSTM": (RNN.LSTM, nn.LSTM, {}), "GRU": (RNN.GRU, nn.GRU, {}),
         "Tanh": (RNN.Tanh, nn.RNN, {"nonlinearity": "tanh"}), "ReLU": (RNN.ReLU, nn.RNN, {"nonlinearity": "relu"})}


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_torch_stacked(kind, layers, bias, batch_first):
    ours_fn, theirs_cls, kw = KINDS[kind]
    ref = theirs_cls(5, 7, layers, bias=bias, batch_first=batch_first, **kw).double()
    model = ours_fn(5, 7, layers, bias=bias, batch_first=batch_first).double()
    for i, cell in enumerate(model.rnns):
        _copy_layer(cell, ref, i)
    x = torch.randn(4, 6, 5, dtype=torch.float64, requires_grad=True)  # [seq, batch] or [batch, seq]
    out, hidden = model(x)
    ref_out, ref_h = ref(x)
    ref_h = ref_h if isinstance(ref_h, tuple) else (ref_h,)
    assert out.shape == ref_out.shape
    assert_rel_close(out, ref_out, tol=1e-12)
    assert_rel_close(list(hidden), list(ref_h), tol=1e-12)
    # Gradients through output and final states, against torch's.
    loss = out.pow(2).sum() + sum(h.sum() for h in hidden)
    ref_loss = ref_out.pow(2).sum() + sum(h.sum() for h in ref_h)
    ours = torch.autograd.grad(loss, [x, *model.parameters()])
    theirs = torch.autograd.grad(ref_loss, [x, *[p for p in ref.parameters()]])
    by_name = dict(zip([n for n, _ in ref.named_parameters()], theirs[1:]))
    mapped = [theirs[0]]
    for i in range(layers):
        names = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if bias else [])
        mapped += [by_name[f"{n}_l{i}"] for n in names]
    assert_rel_close(list(ours), mapped, tol=1e-12)


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_bidirectional_one_layer_matches_torch(kind):
    ours_fn, theirs_cls, kw = KINDS[kind]
    ref = theirs_cls(5, 7, 1, bidirectional=True, **kw).double()
    model = ours_fn(5, 7, 1, bidirectional=True).double()
    _copy_layer(model.fwd.rnns[0], ref, 0)
    _copy_layer(model.bckwrd.rnns[0], ref, 0, "_reverse")
    x = torch.randn(6, 3, 5, dtype=torch.float64, requires_grad=True)
    out, hidden = model(x)
    ref_out, ref_h = ref(x)
    ref_h = ref_h if isinstance(ref_h, tuple) else (ref_h,)
    assert_rel_close(out, ref_out, tol=1e-12)
    for h, r in zip(hidden, ref_h):  # ours: [layer, batch, 2·hidden]; torch: [2·layer, batch, hidden]
        assert_rel_close(h, torch.cat([r[0::2], r[1::2]], -1), tol=1e-12)
    gx = _grads(out, [x])[0]
    assert_rel_close(gx, _grads(ref_out, [x])[0], tol=1e-12)


def test_bidirectional_multi_layer_is_two_independent_stacks():
    """Apex's architecture: a forward stack and a backward stack (each of num_layers) concatenated at the end."""
    model = RNN.LSTM(5, 7, 2, bidirectional=True, batch_first=True).double()
    fwd, bwd = nn.LSTM(5, 7, 2, batch_first=True).double(), nn.LSTM(5, 7, 2, batch_first=True).double()
    for i in range(2):
        _copy_layer(model.fwd.rnns[i], fwd, i)
        _copy_layer(model.bckwrd.rnns[i], bwd, i)
    x = torch.randn(3, 6, 5, dtype=torch.float64, requires_grad=True)
    out, (h, c) = model(x)
    f_out, (fh, fc) = fwd(x)
    b_out, (bh, bc) = bwd(x.flip(1))
    assert_rel_close(out, torch.cat([f_out, b_out.flip(1)], -1), tol=1e-12)
    assert_rel_close([h, c], [torch.cat([fh, bh], -1), torch.cat([fc, bc], -1)], tol=1e-12)
    g = _grads(out, [x, *model.parameters()])
    assert all(t is not None and torch.isfinite(t).all() for t in g)


def test_lstm_output_size_matches_proj_size():
    ref = nn.LSTM(5, 7, 2, proj_size=3).double()
    model = RNN.LSTM(5, 7, 2, output_size=3).double()
    for i, cell in enumerate(model.rnns):
        _copy_layer(cell, ref, i)
    x = torch.randn(4, 2, 5, dtype=torch.float64)
    out, hidden = model(x)
    ref_out, ref_h = ref(x)
    assert_rel_close(out, ref_out, tol=1e-12)
    assert_rel_close(list(hidden), list(ref_h), tol=1e-12)


def _mlstm_ref(x, cells):
    """The multiplicative LSTM written out in float64, step by step."""
    seq, bsz, _ = x.shape
    hs = [torch.zeros(bsz, c.output_size, dtype=x.dtype) for c in cells]
    cs = [torch.zeros(bsz, c.hidden_size, dtype=x.dtype) for c in cells]
    outs = []
    for t in range(seq):
        inp = x[t]
        for k, c in enumerate(cells):
            m = (inp @ c.w_mih.t()) * (hs[k] @ c.w_mhh.t())
            gates = inp @ c.w_ih.t() + m @ c.w_hh.t()
            if c.bias:
                gates = gates + c.b_ih + c.b_hh
            i, f, g, o = gates.chunk(4, 1)
            cs[k] = torch.sigmoid(f) * cs[k] + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(cs[k])
            hs[k] = h @ c.w_ho.t() if c.output_size != c.hidden_size else h
            inp = hs[k]
        outs.append(inp)
    return torch.stack(outs), torch.stack(hs), torch.stack(cs)


@pytest.mark.parametrize("output_size", [None, 4])
@pytest.mark.parametrize("bias", [True, False])
def test_mlstm_matches_formula(bias, output_size):
    model = RNN.mLSTM(5, 6, 2, bias=bias, output_size=output_size).double()
    x = torch.randn(5, 3, 5, dtype=torch.float64, requires_grad=True)
    out, (h, c) = model(x)
    ref_out, ref_h, ref_c = _mlstm_ref(x, list(model.rnns))
    assert_rel_close([out, h, c], [ref_out, ref_h, ref_c], tol=1e-12)
    params = [x, *model.parameters()]
    assert_rel_close(list(_grads(out, params)), list(_grads(ref_out, params)), tol=1e-12)


def test_state_persists_and_resets():
    model = RNN.LSTM(4, 5, 1).double()
    ref = nn.LSTM(4, 5, 1).double()
    _copy_layer(model.rnns[0], ref, 0)
    x1, x2 = torch.randn(3, 2, 4, dtype=torch.float64), torch.randn(3, 2, 4, dtype=torch.float64)
    model(x1)
    out2, _ = model(x2)  # continues from the state after x1
    assert_rel_close(out2, ref(torch.cat([x1, x2]))[0][3:], tol=1e-12)
    model.detach_hidden()
    model.reset_hidden(2)
    assert_rel_close(model(x2)[0], ref(x2)[0], tol=1e-12)
    model.init_inference(5)  # new batch size: fresh zero state
    assert model.rnns[0].hidden[0].shape == (5, 5) and not model.rnns[0].hidden[0].any()


def test_collect_hidden_and_reverse():
    model = RNN.GRU(3, 4, 2).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    out, hid = model(x, collect_hidden=True)
    assert len(hid) == 1 and len(hid[0]) == 5 and hid[0][0].shape == (2, 2, 4)
    assert_rel_close(hid[0][-1][-1], out[-1], tol=0)
    model.reset_hidden(2)
    rout, (rh,) = model(x, reverse=True)
    assert_rel_close(rh[-1], rout[0], tol=0)  # the final state of a reversed pass is at time 0


def test_dropout_between_layers_only_in_training():
    model = RNN.LSTM(3, 4, 2, dropout=0.5).double()
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    model.eval()
    a = model(x)[0]
    model.reset_hidden(2)
    b = model(x)[0]
    assert torch.equal(a, b)
    model.train()
    model.reset_hidden(2)
    assert not torch.equal(model(x)[0], a)


def test_bidirectional_detach_and_bad_input():
    model = RNN.LSTM(3, 4, 1, bidirectional=True)
    with pytest.raises(RuntimeError, match="initialize hidden"):
        model.detach_hidden()
    model(torch.randn(2, 2, 3))
    model.detach_hidden()
    with pytest.raises(ValueError, match="3-D"):
        model(torch.randn(2, 3))
    with pytest.raises(ValueError, match="input_size=3"):
        model(torch.randn(2, 2, 5))
    with pytest.raises(TypeError, match="floating"):
        model(torch.ones(2, 2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="hidden_size"):
        RNN.LSTM(3, 0, 1)
    with pytest.raises(ValueError, match="num_layers"):
        RNN.GRU(3, 4, 0)
    with pytest.raises(ValueError, match="output_size"):
        RNN.GRU(3, 4, 1, output_size=2)
    with pytest.raises(ValueError, match="dropout"):
        RNN.LSTM(3, 4, 2, dropout=1.5)


def test_parameter_layout_and_names():
    model = RNN.LSTM(5, 7, 2, output_size=3)
    names = [n for n, _ in model.named_parameters()]
    assert names == ["rnns.0.w_ih", "rnns.0.w_hh", "rnns.0.w_ho", "rnns.0.b_ih", "rnns.0.b_hh",
                     "rnns.1.w_ih", "rnns.1.w_hh", "rnns.1.w_ho", "rnns.1.b_ih", "rnns.1.b_hh"]
    assert model.rnns[1].w_ih.shape == (28, 3) and model.rnns[0].w_hh.shape == (28, 3)
    bound = 1 / 7 ** 0.5
    assert all(p.abs().max() <= bound for p in model.parameters())
    m = RNN.mLSTM(5, 6, 1)
    assert [n for n, _ in m.named_parameters()][-2:] == ["rnns.0.w_mih", "rnns.0.w_mhh"]
    assert isinstance(RNN.LSTM(2, 3, 1, bidirectional=True), RNN.bidirectionalRNN)
