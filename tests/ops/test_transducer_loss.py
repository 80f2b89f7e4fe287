"""apex.ops.transducer_loss (RNN-T loss): losses and logit gradients against a float64 dynamic programme
on both backends, dense and packed inputs, ragged lengths, and the argument checks."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import apex
from apex.ops import transducer_loss as TL
from apex.testing import TOLERANCES, assert_rel_close


def _ref_loss(x, label, f_len, y_len, blank):
    """Float64 losses (B,) by the textbook recursion over each sequence's lattice, differentiable."""
    lp = torch.log_softmax(x.double(), dim=-1)
    out = []
    for b in range(x.shape[0]):
        T, U = int(f_len[b]), int(y_len[b])
        alpha = {(0, 0): lp.new_zeros(())}
        for t in range(T):
            for u in range(U + 1):
                if t == 0 and u == 0:
                    continue
                terms = []
                if t > 0:
                    terms.append(alpha[t - 1, u] + lp[b, t - 1, u, blank])
                if u > 0:
                    terms.append(alpha[t, u - 1] + lp[b, t, u - 1, int(label[b, u - 1])])
                alpha[t, u] = torch.logsumexp(torch.stack(terms), 0)
        out.append(-(alpha[T - 1, U] + lp[b, T - 1, U, blank]))
    return torch.stack(out)


def _case(B, T, U, V, f_len, y_len, dtype=torch.float32):
    x = torch.randn(B, T, U, V).to(dtype)
    label = torch.randint(0, V - 1, (B, U - 1), dtype=torch.int32)
    return x, label, torch.tensor(f_len, dtype=torch.int32), torch.tensor(y_len, dtype=torch.int32)


def _pack(x, f_len, y_len):
    rows = [x[b, :int(f_len[b]), :int(y_len[b]) + 1].reshape(-1, x.shape[-1]) for b in range(x.shape[0])]
    return torch.cat(rows), torch.cumsum(f_len.long() * (y_len.long() + 1), 0)


def _unpack_grad(gp, x, f_len, y_len):
    out = torch.zeros_like(x, dtype=gp.dtype)
    r = 0
    for b in range(x.shape[0]):
        T, U = int(f_len[b]), int(y_len[b]) + 1
        out[b, :T, :U] = gp[r:r + T * U].view(T, U, -1)
        r += T * U
    return out


_REF_CACHE: dict = {}


def _ref_with_grad(x, label, f_len, y_len, blank, lg):
    # The Python-loop reference is the slow part; the parametrised cases share inputs (fixed seed). It runs
    # on the CPU whatever the device of the case (one tiny kernel per lattice step would crawl on a GPU).
    x, label, f_len, y_len, lg = (t.detach().cpu() for t in (x, label, f_len, y_len, lg))
    key = tuple(hash(t.double().numpy().tobytes()) for t in (x, label, f_len, y_len, lg)) + (blank,)
    if key not in _REF_CACHE:
        x64 = x.double().requires_grad_()
        ref = _ref_loss(x64, label, f_len, y_len, blank)
        _REF_CACHE[key] = (ref.detach(), torch.autograd.grad(ref, x64, lg.double())[0])
    return _REF_CACHE[key]


def _check(x, label, f_len, y_len, blank, dtype, packed, fused):
    lg = torch.rand(x.shape[0]) + 0.5
    ref, ref_g = (r.to(x.device) for r in _ref_with_grad(x, label, f_len, y_len, blank, lg))
    if packed:
        xp, boff = _pack(x, f_len, y_len)
        xp.requires_grad_()
        loss = TL.transducer_loss(xp, label, f_len, y_len, blank, boff, x.shape[1], packed_input=True,
                                  fuse_softmax_backward=fused)
        (gp,) = torch.autograd.grad(loss, xp, lg.to(loss.dtype))
        grad = _unpack_grad(gp, x, f_len, y_len)
    else:
        xx = x.detach().requires_grad_()
        loss = TL.transducer_loss(xx, label, f_len, y_len, blank, fuse_softmax_backward=fused)
        (grad,) = torch.autograd.grad(loss, xx, lg.to(loss.dtype))
    assert loss.dtype == dtype and grad.dtype == dtype
    # One rounding of an fp32 result: within the dtype's single-rounding bound.
    tol = 1e-5 if dtype == torch.float32 else TOLERANCES[dtype]
    assert_rel_close(loss, ref, dtype, tol=tol, name="loss")
    assert_rel_close(grad, ref_g, dtype, tol=tol, name="grad")


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_loss_matches_float64(backend_name, dtype, packed, fused):
    x, label, f_len, y_len = _case(3, 6, 5, 7, [6, 3, 5], [4, 2, 0], dtype)
    _check(x, label, f_len, y_len, 6, dtype, packed, fused)


def test_blank_in_the_middle_and_single_frame(backend_name):
    x, label, f_len, y_len = _case(2, 4, 4, 5, [1, 4], [3, 1])
    label[label == 2] = 4  # blank_idx=2: labels avoid it
    _check(x, label, f_len, y_len, 2, torch.float32, False, True)


def test_non_contiguous_logits(backend_name):
    x, label, f_len, y_len = _case(2, 5, 3, 6, [5, 4], [2, 1])
    xt = x.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strided
    assert not xt.is_contiguous()
    _check(xt, label, f_len, y_len, 5, torch.float32, False, True)


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 7), U=st.integers(1, 5), V=st.integers(2, 9), data=st.data())
def test_ragged_lengths_torch(B, T, U, V, data):
    f_len = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    y_len = data.draw(st.lists(st.integers(0, U - 1), min_size=B, max_size=B))
    x, label, fl, yl = _case(B, T, U, V, f_len, y_len)
    with apex.backend("torch"):
        _check(x, label, fl, yl, V - 1, torch.float32, data.draw(st.booleans()), data.draw(st.booleans()))


def test_triton_and_torch_agree_on_alpha_beta(triton_device):
    x, label, f_len, y_len = _case(3, 6, 4, 5, [6, 2, 4], [3, 3, 1])
    out = {}
    for be in ("torch", "triton"):
        dbg = []
        with apex.backend(be):
            loss = TL.transducer_loss(x, label, f_len, y_len, 4, debug_list=dbg)
        out[be] = (loss, *dbg)
    for b in range(3):
        T, U = int(f_len[b]), int(y_len[b]) + 1
        for i in (1, 2):
            assert_rel_close(out["triton"][i][b, :T, :U], out["torch"][i][b, :T, :U], tol=1e-6)
            # -inf outside the lengths (the kernel writes those cells of its uninitialised buffers itself)
            outside = torch.ones(out["triton"][i].shape[1:], dtype=torch.bool)
            outside[:T, :U] = False
            assert (out["triton"][i][b][outside] == float("-inf")).all()
        assert out["torch"][1][b, 0, 0] == 0
        assert torch.allclose(out["torch"][2][b, 0, 0], -out["torch"][0][b])
    assert_rel_close(out["triton"][0], out["torch"][0], tol=1e-6)


def test_compat_module_matches(backend_name):
    import transducer_loss_cuda

    x, label, f_len, y_len = _case(2, 4, 3, 5, [4, 3], [2, 1])
    lp = torch.log_softmax(x, -1)
    alpha, beta, loss = transducer_loss_cuda.forward(lp, label, f_len, y_len, torch.empty(0), 4, 4, 1, False)
    assert_rel_close(loss, _ref_loss(x, label, f_len, y_len, 4), tol=1e-5)
    lg = torch.ones(2)
    g = transducer_loss_cuda.backward(lp, lg, alpha, beta, f_len, y_len, label, torch.empty(0), 4, 4, 1, True, False)
    x64 = x.double().requires_grad_()
    (ref_g,) = torch.autograd.grad(_ref_loss(x64, label, f_len, y_len, 4).sum(), x64)
    assert_rel_close(g, ref_g, tol=1e-5)
    # Not fused: the gradient of the log-probabilities is zero away from the blank and label entries.
    gs = transducer_loss_cuda.backward(lp, lg, alpha, beta, f_len, y_len, label, torch.empty(0), 4, 4, 1, False,
                                       False)
    assert (gs <= 0).all() and (gs != 0).sum() <= 2 * 4 * 3 * 2


@pytest.mark.parametrize("which", ["loss_grad", "alpha", "beta"])
def test_compat_backward_refuses_tensors_on_another_device(triton_device, which):
    """The Triton backward reads the loss gradient and the lattice next to x: one on another device (``meta``
    standing in) is refused, naming it, before the kernel reads it (the labels and lengths are moved)."""
    import transducer_loss_cuda

    x, label, f_len, y_len = (t.to(triton_device) for t in _case(2, 4, 3, 5, [4, 3], [2, 1]))
    lp = torch.log_softmax(x, -1)
    with apex.backend("triton"):
        none = torch.empty(0, device=triton_device)  # (no batch offsets: not packed)
        alpha, beta, _ = transducer_loss_cuda.forward(lp, label, f_len, y_len, none, 4, 4, 1, False)
        args = {"loss_grad": torch.ones(2, device=triton_device), "alpha": alpha, "beta": beta}
        args[which] = args[which].to("meta")
        with pytest.raises(ValueError, match=f"{which} is on meta"):
            transducer_loss_cuda.backward(lp, args["loss_grad"], args["alpha"], args["beta"], f_len, y_len, label,
                                          none, 4, 4, 1, True, False)


@pytest.mark.parametrize("case,match", [
    ("f_len_too_long", "f_len"), ("y_len_too_long", "y_len"), ("label_range", "label"), ("blank", "blank_idx"),
    ("batch", "batch"), ("offset", "batch_offset"), ("f_len_zero", "f_len"), ("no_offset", "batch_offset"),
    ("x_batch", "x has batch size 3 but f_len has 2"),
])
def test_bad_input(case, match):
    x, label, f_len, y_len = _case(2, 4, 3, 5, [4, 3], [2, 1])
    kw = {}
    if case == "f_len_too_long":
        f_len = torch.tensor([5, 3])
    elif case == "y_len_too_long":
        y_len = torch.tensor([3, 1])
    elif case == "label_range":
        label[0, 0] = 5
    elif case == "blank":
        kw["blank_idx"] = 5
    elif case == "batch":
        f_len, y_len = f_len[:1], y_len[:1]
    elif case == "f_len_zero":
        f_len = torch.tensor([0, 3])
    elif case == "x_batch":  # lengths and labels in range: only x's batch size is wrong
        x = torch.cat((x, x[:1]))
    elif case in ("offset", "no_offset"):
        x, boff = _pack(x, f_len, y_len)
        kw.update(packed_input=True, max_f_len=4, batch_offset=None if case == "no_offset" else boff + 1)
    with pytest.raises(ValueError, match=match):
        TL.transducer_loss(x, label, f_len, y_len, kw.pop("blank_idx", 4), **kw)


def test_checks_read_the_lengths_and_only_the_used_labels():
    """The checks read each length tensor's extremes once and the labels within each row's length only."""
    x, label, f_len, y_len = _case(2, 4, 3, 5, [4, 3], [2, 1])
    label[1, 1] = 99  # past y_len[1] = 1: never read, no error
    ref = TL.transducer_loss(x, label, f_len, y_len, 4)
    label[1, 1] = 0
    # int64 frame lengths with int32 label lengths: the same losses.
    assert torch.equal(TL.transducer_loss(x, label, f_len.long(), y_len, 4), ref)
    label[0, 1] = -1
    with pytest.raises(ValueError, match=r"label values must lie in \[0, 5\), got \[-1, "):
        TL.transducer_loss(x, label, f_len, y_len, 4)
    label[0, 1] = 0
    with pytest.raises(ValueError, match=r"y_len values must lie in \[0, 2\] \(the label length\), got \[-1, 1\]"):
        TL.transducer_loss(x, label, f_len, torch.tensor([1, -1]), 4)
    with pytest.raises(ValueError, match=r"f_len values must be at most x.size\(1\) = 4, got 6"):
        TL.transducer_loss(x, label, torch.tensor([2, 6]), y_len, 4)
    with pytest.raises(ValueError, match=r"y_len \+ 1 must be at most x.size\(2\) = 2, got 3"):
        TL.transducer_loss(x[:, :, :2], label, f_len, y_len, 4)


@pytest.mark.parametrize("edge", ["at_bounds", "f_len_past", "y_len_past_label", "y_len_past_lattice",
                                  "label_v", "label_negative", "uint8_labels"])
def test_checks_bounds_at_their_edges(edge, monkeypatch):
    """The bounds each value is clamped to are the checks' own: every length and used label at its largest
    (or smallest) allowed value passes in one read, one past it raises the message naming it."""
    x, label, f_len, y_len = _case(2, 4, 4, 5, [4, 1], [3, 0])  # f_len = T, y_len = L = U - 1
    label[0] = torch.tensor([0, 4, 4], dtype=torch.int32)  # 0 and V - 1
    match = {"f_len_past": "f_len", "y_len_past_label": "y_len", "y_len_past_lattice": r"y_len \+ 1",
             "label_v": "label", "label_negative": "label"}.get(edge)
    if edge == "f_len_past":
        f_len[1] = 5
    elif edge == "y_len_past_label":
        y_len[1] = 4
    elif edge == "y_len_past_lattice":
        label = torch.cat((label, label[:, :1]), 1)  # L = 4 = U: the lattice bounds y_len
        y_len[1] = 4
    elif edge == "label_v":
        label[0, 2] = 5
    elif edge == "label_negative":
        label[0, 1] = -1
    elif edge == "uint8_labels":  # V - 1 past the dtype's range: no bound
        x = torch.randn(2, 4, 4, 300)
        label, f_len, y_len = (t.to(torch.uint8) for t in (label, f_len, y_len))
        label[0, 2] = 200
    if match is None:
        reads, equal = [], torch.equal
        monkeypatch.setattr(torch, "equal", lambda a, b: reads.append(1) or equal(a, b))
        assert TL.check_args(x, label, f_len, y_len, 4, None, None, False) == (4, 4)
        assert len(reads) == 1
    else:
        with pytest.raises(ValueError, match=match):
            TL.check_args(x, label, f_len, y_len, 4, None, None, False)


def test_checks_make_one_host_read(monkeypatch):
    """A dense input's lengths and labels are checked by one host read (a GPU synchronisation each): the
    values clamped to their bounds compared with themselves (``torch.equal``), no reduction read back; a
    second only when an unused label entry is out of range, and the reads that name the culprit only when
    something is. A packed input's lengths' and used labels' extremes come back in one transfer."""
    x, label, f_len, y_len = _case(2, 4, 3, 5, [4, 3], [2, 1])
    reads = []
    tolist, equal = torch.Tensor.tolist, torch.equal
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(("tolist", t.numel())) or tolist(t))
    monkeypatch.setattr(torch, "equal", lambda a, b: reads.append(("equal", a.numel())) or equal(a, b))
    monkeypatch.setattr(torch.Tensor, "item", lambda t: pytest.fail("item() in the checks"))
    assert TL.check_args(x, label, f_len, y_len, 4, None, None, False) == (4, 3)
    assert reads == [("equal", 2 + 2 + 4)]
    reads.clear()
    assert TL.check_args(x, label[:, :0], f_len, torch.zeros(2, dtype=torch.int32), 4, None, None, False) == (4, 3)
    assert reads == [("equal", 4)]
    reads.clear()
    label[1, 1] = -1  # past y_len[1] = 1: padding, masked on the second try
    assert TL.check_args(x, label, f_len, y_len, 4, None, None, False) == (4, 3)
    assert reads == [("equal", 8), ("equal", 8)]
    reads.clear()
    label[1, 0] = 5  # used: out of range
    with pytest.raises(ValueError, match=r"label values must lie in \[0, 5\), got \[0, 5\]"):
        TL.check_args(x, label, f_len, y_len, 4, None, None, False)
    assert [r[0] for r in reads[:3]] == ["equal", "equal", "tolist"]
    reads.clear()
    label[1, 0] = 0
    xp, boff = _pack(x, f_len, y_len)
    assert TL.check_args(xp, label, f_len, y_len, 4, boff, 4, True) == (4, 3)
    assert [r for r in reads if r[0] == "tolist"] == [("tolist", 6)]


def test_module_without_gradient_records_nothing(backend_name, monkeypatch):
    """Under no_grad the module computes the loss without the autograd Function (no context, nothing
    saved): the same losses, and debug_list still receives alpha and beta."""
    from apex.contrib.transducer import TransducerLoss

    x, label, f_len, y_len = _case(2, 4, 3, 5, [4, 3], [2, 1])
    mod = TransducerLoss()
    ref_debug: list = []
    ref = mod(x.clone().requires_grad_(), label, f_len, y_len, 4, debug_list=ref_debug)

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(TL.TransducerLossFunc, "forward", staticmethod(refuse))
    debug: list = []
    with torch.no_grad():
        loss = mod(x, label, f_len, y_len, 4, debug_list=debug)
    assert loss.grad_fn is None and torch.equal(loss, ref.detach())
    assert len(debug) == 2 and all(torch.equal(a, b) for a, b in zip(debug, ref_debug))


_OUT_OF_RANGE = {  # entry 1 of _case(3, 4, 3, 5, [4, 3, 2], [2, 1, 2]) made out of range
    "f_len_past_T": ("f_len", 5), "f_len_zero": ("f_len", 0), "f_len_negative": ("f_len", -3),
    "y_len_past_U": ("y_len", 3), "y_len_negative": ("y_len", -1), "label_v": ("label", 5),
    "label_negative": ("label", -1),
}


def _no_host_reads(monkeypatch):
    for cls, name in ((torch, "equal"), (torch.Tensor, "tolist"), (torch.Tensor, "item")):
        monkeypatch.setattr(cls, name, lambda *a, _n=name: pytest.fail(f"host read ({_n}) on the Triton path"))


@pytest.mark.parametrize("case", list(_OUT_OF_RANGE))
def test_triton_checks_ranges_in_its_kernels(triton_device, case, monkeypatch):
    """The Triton path reads no length or label back (a GPU synchronisation per call): its kernels check
    them. An entry out of range gets a NaN loss, -inf alpha and beta and a zero gradient, reading nothing out
    of bounds; the other entries are unchanged. The PyTorch path raises the ValueError naming the value."""
    x, label, f_len, y_len = (t.to(triton_device) for t in _case(3, 4, 3, 5, [4, 3, 2], [2, 1, 2]))
    label[1] = torch.tensor([1, 99])  # past y_len[1] = 1: padding, never read
    x.requires_grad_()
    refs = {}
    with apex.backend("triton"):
        for fused in (True, False):
            ref = TL.transducer_loss(x, label, f_len, y_len, 4, fuse_softmax_backward=fused)
            refs[fused] = ref, torch.autograd.grad(ref.sum(), x)[0]
    what, value = _OUT_OF_RANGE[case]
    {"f_len": f_len, "y_len": y_len, "label": label[1]}[what][0 if what == "label" else 1] = value
    with apex.backend("torch"), pytest.raises(ValueError, match=what):
        TL.transducer_loss(x.cpu(), label.cpu(), f_len.cpu(), y_len.cpu(), 4)
    for fused, (ref, ref_g) in refs.items():
        debug: list = []
        with monkeypatch.context() as m, apex.backend("triton"):
            _no_host_reads(m)
            loss = TL.transducer_loss(x, label, f_len, y_len, 4, fuse_softmax_backward=fused, debug_list=debug)
            (grad,) = torch.autograd.grad(loss.sum(), x)
        assert torch.isnan(loss[1]) and torch.equal(loss[[0, 2]], ref[[0, 2]])
        assert (grad[1] == 0).all() and torch.equal(grad[[0, 2]], ref_g[[0, 2]])
        assert all((t[1] == float("-inf")).all() for t in debug)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_compiles_in_one_graph(backend_name, device, fused, packed):
    """torch.compile(fullgraph=True) records the loss as its custom ops (the Function's Python, its backend
    choice and the PyTorch path's range checks cannot be traced); values, gradients and debug_list as eager."""
    from apex.contrib.transducer import TransducerLoss

    x, label, f_len, y_len = (t.to(device) for t in _case(2, 4, 3, 5, [4, 3], [2, 1]))
    kw = {}
    if packed:
        x, boff = _pack(x, f_len, y_len)
        kw = dict(batch_offset=boff, max_f_len=4)
    x.requires_grad_()
    mod = TransducerLoss(fuse_softmax_backward=fused, packed_input=packed)
    seen: list[str] = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    def step(debug):
        return mod(x, label, f_len, y_len, 4, debug_list=debug, **kw)

    torch._dynamo.reset()
    debug: list = []
    # The packed lattice's U (max(y_len) + 1) is known when the op runs: before torch 2.11, Dynamo records such
    # an output only with capture_dynamic_output_shape_ops (docs/contrib.md).
    old_torch = packed and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 11)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True) if old_torch else contextlib.nullcontext():
        loss = torch.compile(lambda: step(debug), fullgraph=True, backend=record)()
    (grad,) = torch.autograd.grad(loss.sum(), x)
    ref_debug: list = []
    ref = step(ref_debug)
    (ref_g,) = torch.autograd.grad(ref.sum(), x)
    assert "apex.transducer_loss_fwd.default" in seen
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    torch.testing.assert_close(grad, ref_g, rtol=0, atol=0)
    assert len(debug) == 2 and all(torch.equal(a, b) for a, b in zip(debug, ref_debug))
    torch._dynamo.reset()
