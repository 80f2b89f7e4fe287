"""apex.ops.transducer_joint (RNN-T joint): dense and packed outputs, ReLU and dropout masks, gradients of
f and g against float64 on both backends, and the argument checks."""

from __future__ import annotations

import pytest
import torch

from apex.ops import transducer_joint as TJ
from apex.testing import TOLERANCES, assert_rel_close


def _inputs(B, T, U, H, f_len, g_len, dtype):
    f = torch.randn(B, T, H).to(dtype).requires_grad_()
    g = torch.randn(B, U, H).to(dtype).requires_grad_()
    return f, g, torch.tensor(f_len, dtype=torch.int32), torch.tensor(g_len, dtype=torch.int32)


def _valid(f_len, g_len, T, U):
    t_ok = torch.arange(T).view(1, T, 1) < f_len.view(-1, 1, 1)
    return t_ok & (torch.arange(U).view(1, 1, U) < g_len.view(-1, 1, 1))


def _ref(f, g, f_len, g_len, dh_grid, relu, pack):
    """Float64 output (dense with −1 padding, or packed) and gradients of f and g."""
    f64, g64 = f.detach().double().requires_grad_(), g.detach().double().requires_grad_()
    h = f64.unsqueeze(2) + g64.unsqueeze(1)
    if relu:
        h = torch.relu(h)
    valid = _valid(f_len, g_len, f.shape[1], g.shape[1])
    df, dg = torch.autograd.grad(h, (f64, g64), dh_grid.double() * valid.unsqueeze(-1))
    h = h.detach()
    return (h[valid] if pack else h.masked_fill(~valid.unsqueeze(-1), -1)), df, dg


@pytest.mark.parametrize("tile", [1, 4])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_joint_matches_float64(backend_name, dtype, pack, relu, tile):
    B, T, U, H = 3, 5, 4, 37
    f, g, f_len, g_len = _inputs(B, T, U, H, [5, 2, 4], [3, 4, 1], dtype)
    valid = _valid(f_len, g_len, T, U)
    dh_grid = torch.randn(B, T, U, H).to(dtype)
    kw = {}
    if pack:
        boff = torch.cumsum(f_len.long() * g_len.long(), 0)
        kw = dict(batch_offset=boff, packed_batch=int(boff[-1]))
    probe = []
    h = TJ.transducer_joint(f, g, f_len, g_len, pack_output=pack, relu=relu, tile_size=tile, mask_probe=probe, **kw)
    dh = dh_grid[valid] if pack else dh_grid
    df, dg = torch.autograd.grad(h, (f, g), dh)
    ref_h, ref_df, ref_dg = _ref(f, g, f_len, g_len, dh_grid, relu, pack)
    assert h.dtype == dtype and h.shape == ref_h.shape
    tol = 1e-6 if dtype == torch.float32 else TOLERANCES[dtype]
    assert_rel_close(h, ref_h, dtype, tol=tol, name="h")
    # gradients: sums of up to max(T, U) terms in fp32, one rounding
    assert_rel_close([df, dg], [ref_df, ref_dg], dtype, tol=tol, name="grads")
    assert (df[1, 2:] == 0).all() and (dg[2, 1:] == 0).all()  # nothing outside the lengths
    if relu:
        (mask,) = probe
        assert mask.dtype == torch.uint8 and mask.shape == h.shape
        assert torch.equal(mask.bool(), (ref_h > 0) if pack else (ref_h > 0) & valid.unsqueeze(-1))
    else:
        assert probe == []


@pytest.mark.parametrize("pack", [False, True])
def test_dropout_mask_scale_and_gradients(backend_name, pack):
    B, T, U, H, p = 2, 3, 4, 160, 0.3
    f, g, f_len, g_len = _inputs(B, T, U, H, [3, 2], [4, 3], torch.float32)
    valid = _valid(f_len, g_len, T, U)
    kw = {}
    if pack:
        boff = torch.cumsum(f_len.long() * g_len.long(), 0)
        kw = dict(batch_offset=boff, packed_batch=int(boff[-1]))
    probe = []
    h = TJ.transducer_joint(f, g, f_len, g_len, pack_output=pack, dropout=True, dropout_prob=p, mask_probe=probe,
                            **kw)
    (mask,) = probe
    full = (f.detach().unsqueeze(2) + g.detach().unsqueeze(1))
    full = full[valid] if pack else full
    keep = mask.bool() if pack else mask.bool()[valid]
    kept = keep.float().mean().item()
    assert abs(kept - (1 - p)) < 0.05, kept
    expect = torch.where(mask.bool(), full / (1 - p), 0.0)
    got = h if pack else torch.where(valid.unsqueeze(-1), h, 0.0)
    if not pack:
        expect = torch.where(valid.unsqueeze(-1), expect, 0.0)
    assert_rel_close(got, expect, tol=1e-6)
    dh = torch.randn_like(h)
    df, dg = torch.autograd.grad(h, (f, g), dh)
    m = torch.zeros(B, T, U, H)
    dgrid = torch.zeros(B, T, U, H)
    if pack:
        m[valid], dgrid[valid] = mask.float(), dh
    else:
        m, dgrid = mask.float() * valid.unsqueeze(-1), dh
    eff = dgrid * m / (1 - p)
    assert_rel_close([df, dg], [eff.sum(2), eff.sum(1)], tol=1e-6)


def test_compat_module(backend_name):
    import transducer_joint_cuda

    f, g, f_len, g_len = _inputs(2, 3, 4, 8, [3, 2], [4, 2], torch.float32)
    out = transducer_joint_cuda.forward(f.detach(), g.detach(), f_len, g_len, torch.empty(0), 0, 1, False, True,
                                        False, 0.0, 4)
    assert len(out) == 2 and out[1].dtype == torch.uint8
    ref = torch.relu(f.detach().unsqueeze(2) + g.detach().unsqueeze(1))
    valid = _valid(f_len, g_len, 3, 4).unsqueeze(-1)
    assert torch.equal(out[0], torch.where(valid, ref, -1.0))
    dh = torch.randn(2, 3, 4, 8)
    df, dg = transducer_joint_cuda.backward([dh, out[1]], f_len, g_len, torch.empty(0), 3, 4, False, 1.0)
    eff = dh * out[1] * valid
    assert_rel_close([df, dg], [eff.sum(2), eff.sum(1)], tol=1e-6)
    assert len(transducer_joint_cuda.forward(f.detach(), g.detach(), f_len, g_len, torch.empty(0), 0, 0, False,
                                             False, False, 0.0, 4)) == 1


@pytest.mark.parametrize("case,exc,match", [
    ("f_len", ValueError, "f_len"), ("g_len", ValueError, "g_len"), ("dtype", ValueError, "g has"),
    ("no_offset", ValueError, "batch_offset"), ("packed_batch", ValueError, "packed_batch"),
    ("offset", ValueError, "batch_offset"), ("prob", ValueError, "dropout_prob"), ("tile", ValueError, "tile"),
    ("float_len", ValueError, "f_len"),
    ("f_len_negative", ValueError, r"f_len values must lie in \[0, 3\], got \[-1, 2\]"),
])
def test_bad_input(case, exc, match):
    f, g, f_len, g_len = _inputs(2, 3, 4, 8, [3, 2], [4, 2], torch.float32)
    kw = {}
    boff = torch.cumsum(f_len.long() * g_len.long(), 0)
    if case == "f_len":
        f_len = torch.tensor([4, 2])
    elif case == "g_len":
        g_len = torch.tensor([5, 2])
    elif case == "dtype":
        g = g.double()
    elif case == "no_offset":
        kw = dict(pack_output=True, packed_batch=16)
    elif case == "packed_batch":
        kw = dict(pack_output=True, batch_offset=boff, packed_batch=15)
    elif case == "offset":
        kw = dict(pack_output=True, batch_offset=boff + 1, packed_batch=16)
    elif case == "prob":
        kw = dict(dropout=True, dropout_prob=1.0)
    elif case == "tile":
        kw = dict(tile_size=3)
    elif case == "float_len":
        f_len = f_len.float()
    elif case == "f_len_negative":
        f_len = torch.tensor([-1, 2])
    with pytest.raises(exc, match=match):
        TJ.transducer_joint(f, g, f_len, g_len, **kw)


def test_checks_make_one_host_read(monkeypatch):
    """Both lengths are checked by one host read (a GPU synchronisation each): the lengths clamped to their
    bounds compared with themselves (``torch.equal``), no reduction read back; their extremes come back (in
    one transfer) only when a length is out of range, for the messages that name it. Lengths at their
    bounds pass."""
    f, g = torch.randn(2, 5, 4), torch.randn(2, 3, 4)
    f_len, g_len = torch.tensor([5, 0], dtype=torch.int32), torch.tensor([3, 2])
    reads = []
    tolist, equal = torch.Tensor.tolist, torch.equal
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(("tolist", t.numel())) or tolist(t))
    monkeypatch.setattr(torch, "equal", lambda a, b: reads.append(("equal", a.numel())) or equal(a, b))
    TJ._check(f, g, f_len, g_len, None, 0, False, 0.0)
    assert reads == [("equal", 4)]
    reads.clear()
    with pytest.raises(ValueError, match=r"f_len values must lie in \[0, 5\], got \[4, 6\]"):
        TJ._check(f, g, torch.tensor([6, 4]), g_len, None, 0, False, 0.0)
    assert reads == [("equal", 4), ("tolist", 4)]
    with pytest.raises(ValueError, match=r"g_len values must lie in \[0, 3\], got \[-1, 3\]"):
        TJ._check(f, g, f_len, torch.tensor([3, -1]), None, 0, False, 0.0)
    with pytest.raises(ValueError, match=r"g_len values must lie in \[0, 3\], got \[2, 4\]"):
        TJ._check(f, g, f_len.to(torch.uint8), torch.tensor([4, 2], dtype=torch.uint8), None, 0, False, 0.0)


def test_module_without_gradient_records_nothing(backend_name, monkeypatch):
    """With no input requiring grad the module computes the joint without the autograd Function: the same
    output, and the ReLU mask still reaches the probe."""
    from apex.contrib.transducer import TransducerJoint

    f, g = torch.randn(2, 5, 4), torch.randn(2, 3, 4)
    f_len, g_len = torch.tensor([5, 4], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    mod = TransducerJoint(relu=True, probe_mask=True)
    ref = mod(f.clone().requires_grad_(), g, f_len, g_len)

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(TJ.TransducerJointFunc, "forward", staticmethod(refuse))
    h = mod(f, g, f_len, g_len)
    assert h.grad_fn is None and torch.equal(h, ref.detach())
    assert len(mod.mask_probe) == 2 and torch.equal(mod.mask_probe[0], mod.mask_probe[1])


@pytest.mark.no_triton_launch("refused before any launch")
@pytest.mark.parametrize("case", ["g", "lengths", "g_packed", "backward_mask", "backward_lengths"])
def test_triton_path_refuses_tensors_on_another_device(triton_device, case):
    """The Triton path's kernels read g, the lengths and the backward's mask next to f (or the gradient): one
    on another device (``meta`` standing in) is refused, naming it, before a kernel reads it."""
    import apex

    f, g, f_len, g_len = (t.detach().to(triton_device)
                          for t in _inputs(3, 5, 4, 8, [5, 2, 4], [3, 4, 1], torch.float32))
    with apex.backend("triton"):
        if case.startswith("backward"):
            h, mask = TJ.joint_forward(f, g, f_len, g_len, relu=True)
            if case == "backward_mask":
                mask, name = mask.to("meta"), "mask"
            else:
                f_len, g_len, name = f_len.to("meta"), g_len.to("meta"), "f_len"
            with pytest.raises(ValueError, match=f"{name} is on meta"):
                TJ.joint_backward(torch.randn_like(h), mask, f_len, g_len, None, 5, 4, False)
            return
        pack = case == "g_packed"
        boff = torch.cumsum(f_len * g_len, 0)
        if case == "lengths":
            f_len, g_len, name = f_len.to("meta"), g_len.to("meta"), "f_len"
        else:
            g, name = g.to("meta"), "g"
        with pytest.raises(ValueError, match=f"{name} is on meta"):
            TJ.transducer_joint(f, g, f_len, g_len, boff, int(boff[-1]), pack_output=pack)


@pytest.mark.parametrize("case", ["f_len_past_T", "f_len_negative", "g_len_past_U", "g_len_negative"])
def test_triton_checks_ranges_in_its_kernels(triton_device, case, monkeypatch):
    """A dense output's Triton path reads no length back (a GPU synchronisation per call): its kernels check
    them. An entry out of range gets NaN everywhere, a zero mask and zero gradients, reading nothing out of
    bounds; the other entries are unchanged. The PyTorch path raises the ValueError naming the length."""
    import apex

    f, g, f_len, g_len = (t.to(triton_device) for t in _inputs(3, 5, 4, 8, [5, 2, 4], [3, 4, 1], torch.float32))
    f, g = f.detach().requires_grad_(), g.detach().requires_grad_()
    dh = torch.randn(3, 5, 4, 8, device=triton_device)
    with apex.backend("triton"):
        ref = TJ.transducer_joint(f, g, f_len, g_len, relu=True)
        ref_df, ref_dg = torch.autograd.grad(ref, (f, g), dh)
    name, value = {"f_len_past_T": ("f_len", 6), "f_len_negative": ("f_len", -1), "g_len_past_U": ("g_len", 5),
                   "g_len_negative": ("g_len", -2)}[case]
    (f_len if name == "f_len" else g_len)[1] = value
    with apex.backend("torch"), pytest.raises(ValueError, match=name):
        TJ.transducer_joint(f.cpu(), g.cpu(), f_len.cpu(), g_len.cpu())
    probe: list = []
    with monkeypatch.context() as m, apex.backend("triton"):
        for cls, attr in ((torch, "equal"), (torch.Tensor, "tolist"), (torch.Tensor, "item")):
            m.setattr(cls, attr, lambda *a, _n=attr: pytest.fail(f"host read ({_n}) on the Triton path"))
        h = TJ.transducer_joint(f, g, f_len, g_len, relu=True, mask_probe=probe)
        df, dg = torch.autograd.grad(h, (f, g), dh)
    assert torch.isnan(h[1]).all() and torch.equal(h[[0, 2]], ref[[0, 2]])
    assert (probe[0][1] == 0).all()
    assert (df[1] == 0).all() and (dg[1] == 0).all()
    assert torch.equal(df[[0, 2]], ref_df[[0, 2]]) and torch.equal(dg[[0, 2]], ref_dg[[0, 2]])


@pytest.mark.parametrize("pack", [False, True])
def test_compiles_in_one_graph(backend_name, device, pack):
    """torch.compile(fullgraph=True) records the joint as its custom ops (the Function's Python, its backend
    choice and the PyTorch path's range checks cannot be traced); values, gradients and the mask as eager."""
    from apex.contrib.transducer import TransducerJoint

    f, g, f_len, g_len = (t.to(device) for t in _inputs(2, 5, 4, 8, [5, 3], [4, 2], torch.float32))
    f, g = f.detach().requires_grad_(), g.detach().requires_grad_()
    boff = torch.cumsum(f_len.long() * g_len.long(), 0)
    mod = TransducerJoint(pack_output=pack, relu=True, probe_mask=True)
    seen: list[str] = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes)
        return gm.forward

    def step():
        return mod(f, g, f_len, g_len, boff, 26) if pack else mod(f, g, f_len, g_len)

    torch._dynamo.reset()
    h = torch.compile(step, fullgraph=True, backend=record)()
    grads = torch.autograd.grad(h.square().sum(), (f, g))
    ref = step()
    ref_grads = torch.autograd.grad(ref.square().sum(), (f, g))
    assert "apex.transducer_joint_fwd.default" in seen
    torch.testing.assert_close(h, ref, rtol=0, atol=0)
    torch.testing.assert_close(grads, ref_grads, rtol=0, atol=0)
    assert len(mod.mask_probe) == 2 and torch.equal(mod.mask_probe[0], mod.mask_probe[1])
    torch._dynamo.reset()
