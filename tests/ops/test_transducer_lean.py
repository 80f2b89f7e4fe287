"""The planned eager Triton paths of the transducer joint and loss (apex.ops._transducer_direct): the same bits,
masks, debug lattices, launches and errors as the general path for every layout and option, repeat calls that
take the last plan on its guard, and the lengths' and labels' values checked at every call (by the kernels, as
on the general path: an entry out of range gets NaN), however warm the plan."""

from __future__ import annotations

import contextlib

import pytest
import torch

import apex
from apex.contrib.transducer import TransducerJoint, TransducerLoss
from apex.contrib.transducer import transducer as M
from apex.ops import _transducer_direct as D
from apex.ops import transducer_joint as TJ
from apex.ops import transducer_loss as TL
from tests import _device
from tests.ops._lean import record_launches, same_tensors

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the general path by design")

F32, I32, I64 = torch.float32, torch.int32, torch.int64
NO_OPTS = (False, False, 0.0, 4)  # relu, dropout, dropout_prob, tile


@contextlib.contextmanager
def _general(monkeypatch):
    """The general path: the lean entries switched off where the ops and the modules call them."""
    with monkeypatch.context() as m:
        for owner, name in ((TJ, "_lean"), (TL, "_lean"), (M, "_joint_lean"), (M, "_loss_lean")):
            m.setattr(owner, name, lambda *a: None)
        yield


@contextlib.contextmanager
def _lean_only(monkeypatch):
    """Any use of the general path fails: what runs in the block is the lean path's."""
    def refuse(*a, **k):
        raise AssertionError("the general path ran")

    with monkeypatch.context() as m:
        for owner, name in ((TJ, "joint_forward_saved"), (M, "joint_forward_saved"), (TL, "loss_and_saved"),
                            (M, "loss_and_saved"), (TJ, "traced_apply"), (TL, "traced_apply")):
            m.setattr(owner, name, refuse)
        m.setattr(TJ.TransducerJointFunc, "forward", staticmethod(refuse))
        m.setattr(TL.TransducerLossFunc, "forward", staticmethod(refuse))
        yield


def _no_host_reads(m):
    for cls, name in ((torch, "equal"), (torch.Tensor, "tolist"), (torch.Tensor, "item")):
        m.setattr(cls, name, lambda *a, _n=name: pytest.fail(f"host read ({_n}) on the Triton path"))


def _leaf(t, rg):
    return t.detach().clone().requires_grad_(rg)


def _outcome(fn):
    """``fn()``'s tensors, or its error's type and message."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - compared with the other path's
        return type(exc), str(exc)


def _same(a, b):
    if isinstance(a, tuple) and isinstance(a[0], type):  # an error: the same type and message
        assert a == b, (a, b)
        return
    assert not (isinstance(b, tuple) and isinstance(b[0], type)), b
    same_tensors(a, b)


# ------------------------------------------------------------------------------------------------- joint
def _joint_inputs(dev, dtype=F32, lens=I32, layout="contiguous", B=3, T=5, U=4, H=8):
    if layout == "contiguous":
        f, g = torch.randn(B, T, H, device=dev), torch.randn(B, U, H, device=dev)
    else:  # a slice of wider rows, and a transposed buffer
        f = torch.randn(B, T, H + 3, device=dev)[..., 1:H + 1]
        g = torch.randn(B, H, U, device=dev).transpose(1, 2)
    f_len = torch.tensor([T, 2, 4, 1][:B], device=dev, dtype=lens)
    g_len = torch.tensor([3, U, 1, 2][:B], device=dev, dtype=lens)
    return f.to(dtype), g.to(dtype), f_len, g_len


def _joint(entry, f, g, f_len, g_len, opts, dh, rg=(True, True), seed=0):
    """``[h, grads..., masks...]`` of one call (``entry``: the module or the function)."""
    relu, dropout, prob, tile = opts
    f, g = _leaf(f, rg[0]), _leaf(g, rg[1])
    torch.manual_seed(seed)  # (dropout: both paths draw their seed from this stream)
    if entry == "module":
        mod = TransducerJoint(relu=relu, dropout=dropout, dropout_prob=prob, fwd_tile_size=tile, probe_mask=True)
        h, probe = mod(f, g, f_len, g_len), mod.mask_probe or []
    else:
        probe = []
        h = TJ.transducer_joint(f, g, f_len, g_len, relu=relu, dropout=dropout, dropout_prob=prob, tile_size=tile,
                                mask_probe=probe)
    wrt = [t for t in (f, g) if t.requires_grad]
    grads = list(torch.autograd.grad(h, wrt, dh)) if h.requires_grad else []
    return [h, *grads, *probe]


def _joint_both(monkeypatch, entry, f, g, f_len, g_len, opts, rg=(True, True)):
    dh = torch.randn(*f.shape[:2], g.shape[1], f.shape[2], device=f.device).to(f.dtype)
    with _lean_only(monkeypatch):
        lean = _joint(entry, f, g, f_len, g_len, opts, dh, rg)
    with _general(monkeypatch):
        general = _joint(entry, f, g, f_len, g_len, opts, dh, rg)
    return lean, general


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("opts", [NO_OPTS, (True, False, 0.0, 1), (False, True, 0.25, 2), (True, True, 0.5, 4)],
                         ids=str)
def test_joint_lean_matches_the_general_path(triton_device, monkeypatch, dtype, opts):
    with apex.backend("triton"):
        for entry in ("module", "function", "module"):  # a miss, then hits: fresh values each time
            _same(*_joint_both(monkeypatch, entry, *_joint_inputs(triton_device, dtype), opts))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("lens", [I32, I64, "strided"], ids=str)
def test_joint_layouts_and_length_dtypes(triton_device, monkeypatch, layout, lens):
    with apex.backend("triton"):
        for entry in ("module", "function"):
            f, g, f_len, g_len = _joint_inputs(triton_device, F32, I64 if lens == "strided" else lens, layout)
            if lens == "strided":  # every other element of a longer buffer
                f_len, g_len = torch.stack([f_len, f_len], 1)[:, 0], torch.stack([g_len, g_len], 1)[:, 0]
            _same(*_joint_both(monkeypatch, entry, f, g, f_len, g_len, (True, False, 0.0, 4)))


@pytest.mark.parametrize("case", ["f_len_past_T", "f_len_negative", "g_len_past_U", "g_len_negative", "in_range"])
def test_joint_repeat_calls_check_the_changed_lengths(triton_device, monkeypatch, case):
    """The plan covers metadata only: new length values on a warm plan (guard hit, no key built) are checked as
    the general path checks them (its kernels: NaN for the entry out of range), with no host read."""
    f, g, f_len, g_len = _joint_inputs(triton_device)
    opts = (True, False, 0.0, 4)
    keys = []
    with apex.backend("triton"):
        _same(*_joint_both(monkeypatch, "module", f, g, f_len, g_len, opts))
        name, value = {"f_len_past_T": ("f", 6), "f_len_negative": ("f", -1), "g_len_past_U": ("g", 5),
                       "g_len_negative": ("g", -2), "in_range": ("g", 2)}[case]
        (f_len if name == "f" else g_len)[1] = value
        with monkeypatch.context() as m:
            _no_host_reads(m)
            key = D._key
            m.setattr(D, "_key", lambda t: keys.append(t) or key(t))
            lean, general = _joint_both(monkeypatch, "module", f, g, f_len, g_len, opts)
    assert keys == []  # the last plan, on its guard
    _same(lean, general)
    assert torch.isnan(lean[0][1]).all() != (case == "in_range")


def test_joint_changed_options_and_requires_grad(triton_device, monkeypatch):
    """After a warm call each change of an option (ReLU, dropout and its probability, tile, packing) or of
    which inputs need a gradient gives the general path's values, masks and gradients."""
    f, g, f_len, g_len = _joint_inputs(triton_device)
    variants = [(NO_OPTS, (True, True)), ((True, False, 0.0, 4), (True, True)), ((False, True, 0.25, 4), (True, True)),
                ((False, True, 0.5, 4), (True, True)), ((False, True, 0, 4), (True, True)),
                ((False, False, 0.0, 1), (True, True)), ((False, False, 0.0, 2), (True, True)),
                (NO_OPTS, (True, False)), (NO_OPTS, (False, True)), (NO_OPTS, (False, False)), (NO_OPTS, (True, True))]
    with apex.backend("triton"):
        for opts, rg in variants:
            _same(*_joint_both(monkeypatch, "function", f, g, f_len, g_len, opts, rg))
        with torch.no_grad():
            _same(*_joint_both(monkeypatch, "module", f, g, f_len, g_len, (True, False, 0.0, 4)))
        # Packing: the general path (not planned), right after a planned call.
        boff = torch.cumsum(f_len.long() * g_len.long(), 0)
        fp = _leaf(f, True)
        h = TransducerJoint(pack_output=True)(fp, g, f_len, g_len, boff, int(boff[-1]))
        dense = TJ.transducer_joint(f, g, f_len, g_len)
        valid = (torch.arange(5, device=f.device).view(1, 5, 1) < f_len.view(-1, 1, 1).cpu().to(f.device)) & (
            torch.arange(4, device=f.device).view(1, 1, 4) < g_len.view(-1, 1, 1))
        assert h.shape == (int(boff[-1]), 8) and torch.equal(h, dense.detach()[valid])


def test_joint_module_eval_turns_dropout_off(triton_device, monkeypatch):
    f, g, f_len, g_len = _joint_inputs(triton_device)
    mod = TransducerJoint(dropout=True, dropout_prob=0.5)
    with apex.backend("triton"):
        mod(f, g, f_len, g_len)
        mod.eval()
        with _lean_only(monkeypatch):
            h = mod(f, g, f_len, g_len)
        assert torch.equal(h, TJ.transducer_joint(f, g, f_len, g_len))


def test_joint_errors_after_a_warm_call(triton_device, monkeypatch):
    f, g, f_len, g_len = _joint_inputs(triton_device)
    cases = [dict(g=g.double()), dict(f_len=f_len.float()), dict(g_len=g_len[:2]), dict(tile_size=3),
             dict(dropout=True, dropout_prob=1.0), dict(dropout=True, dropout_prob=float("nan")),
             dict(f=f[:, :, :4]), dict(relu=1), dict(tile_size=True)]
    with apex.backend("triton"):
        for kw in cases:
            TJ.transducer_joint(f, g, f_len, g_len)  # warm: the plan of the good call
            args = {"f": f, "g": g, "f_len": f_len, "g_len": g_len, **kw}
            lean = _outcome(lambda a=args: [TJ.transducer_joint(**a)])
            with _general(monkeypatch):
                general = _outcome(lambda a=args: [TJ.transducer_joint(**a)])
            _same(lean, general)
        with pytest.raises(ValueError, match="Please specify batch_offset"):
            TransducerJoint(pack_output=True)(f, g, f_len, g_len)


def test_joint_inplace_change_of_a_saved_length_is_an_error(triton_device, monkeypatch):
    f, g, f_len, g_len = _joint_inputs(triton_device)
    errors = []
    with apex.backend("triton"):
        for ctx in (contextlib.nullcontext(), _general(monkeypatch)):
            with ctx:
                fl = f_len.clone()
                h = TJ.transducer_joint(_leaf(f, True), g, fl, g_len)
                fl.add_(0)
                errors.append(_outcome(lambda h=h: h.sum().backward()))
    assert errors[0][0] is RuntimeError and "modified by an inplace operation" in errors[0][1]
    assert errors[0] == errors[1]


@pytest.mark.no_triton_launch("launches recorded, not run")
def test_joint_launches_as_the_general_path(triton_device, monkeypatch):
    from apex._kernels import transducer_joint as K

    f, g, f_len, g_len = _joint_inputs(triton_device, lens=I64, layout="strided")
    with apex.backend("triton"):
        for opts in (NO_OPTS, (True, True, 0.25, 2)):
            seen = []
            for ctx in (contextlib.nullcontext(), _general(monkeypatch)):
                with ctx, monkeypatch.context() as m:
                    launches = record_launches(m, [K._joint_fwd, K._joint_bwd])
                    _joint("module", f, g, f_len, g_len, opts, torch.ones(3, 5, 4, 8, device=f.device))
                    seen.append(launches)
            assert len(seen[0]) == 3 and seen[0] == seen[1]


# -------------------------------------------------------------------------------------------------- loss
def _loss_inputs(dev, dtype=F32, lens=I32, layout="contiguous", B=3, T=4, U=3, V=6):
    x = torch.randn(B, T, U, V + (2 if layout == "strided" else 0), device=dev)[..., :V].to(dtype)
    label = torch.randint(0, V - 1, (B, U - 1), device=dev, dtype=I32)
    if layout == "strided":
        label = torch.stack([label, label], 2)[..., 0]
    f_len = torch.tensor([T, 3, 2, 1][:B], device=dev, dtype=lens)
    y_len = torch.tensor([2, 1, 2, 0][:B], device=dev, dtype=lens)
    return x, label, f_len, y_len


def _loss(entry, x, label, f_len, y_len, blank=5, fused=True, rg=True, opt=1):
    """``[losses, alpha, beta, grad or nothing]`` of one call."""
    x = _leaf(x, rg)
    debug: list = []
    if entry == "module":
        loss = TransducerLoss(fuse_softmax_backward=fused, opt=opt)(x, label, f_len, y_len, blank, debug_list=debug)
    else:
        loss = TL.transducer_loss(x, label, f_len, y_len, blank, fuse_softmax_backward=fused, debug_list=debug)
    lg = torch.linspace(0.5, 1.5, loss.shape[0], device=x.device).to(loss.dtype)
    grads = list(torch.autograd.grad(loss, x, lg)) if loss.requires_grad else []
    return [loss, *debug, *grads]


def _loss_both(monkeypatch, entry, *args, **kw):
    with _lean_only(monkeypatch):
        lean = _loss(entry, *args, **kw)
    with _general(monkeypatch):
        general = _loss(entry, *args, **kw)
    return lean, general


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("fused", [True, False])
def test_loss_lean_matches_the_general_path(triton_device, monkeypatch, dtype, fused):
    with apex.backend("triton"):
        for entry in ("module", "function", "module"):  # a miss, then hits: fresh values each time
            _same(*_loss_both(monkeypatch, entry, *_loss_inputs(triton_device, dtype), fused=fused))


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("lens", [I32, I64, torch.uint8], ids=str)
def test_loss_layouts_and_length_dtypes(triton_device, monkeypatch, layout, lens):
    with apex.backend("triton"):
        for entry in ("module", "function"):
            _same(*_loss_both(monkeypatch, entry, *_loss_inputs(triton_device, F32, lens, layout)))


@pytest.mark.parametrize("case", ["f_len_past_T", "f_len_zero", "y_len_past_U", "y_len_negative", "label_v",
                                  "label_negative", "in_range"])
def test_loss_repeat_calls_check_the_changed_values(triton_device, monkeypatch, case):
    """New length and label values on a warm plan (guard hit, no key built) are checked as the general path
    checks them (its kernels: a NaN loss and a zero gradient for the entry out of range), with no host read."""
    x, label, f_len, y_len = _loss_inputs(triton_device)
    keys = []
    with apex.backend("triton"):
        _same(*_loss_both(monkeypatch, "module", x, label, f_len, y_len))
        what, value = {"f_len_past_T": ("f", 5), "f_len_zero": ("f", 0), "y_len_past_U": ("y", 3),
                       "y_len_negative": ("y", -1), "label_v": ("label", 6), "label_negative": ("label", -1),
                       "in_range": ("y", 2)}[case]
        {"f": f_len, "y": y_len, "label": label[1]}[what][0 if what == "label" else 1] = value
        with monkeypatch.context() as m:
            _no_host_reads(m)
            key = D._key
            m.setattr(D, "_key", lambda t: keys.append(t) or key(t))
            for fused in (True, False):
                lean, general = _loss_both(monkeypatch, "module", x, label, f_len, y_len, fused=fused)
                _same(lean, general)
                assert bool(torch.isnan(lean[0][1])) != (case == "in_range")
    assert keys == []  # the last plan, on its guard


def test_loss_changed_blank_opt_fused_and_requires_grad(triton_device, monkeypatch):
    """After a warm call each change of ``blank_idx`` (in range or not), ``opt``, ``fuse_softmax_backward`` or of
    whether x needs a gradient gives the general path's values, gradients and errors."""
    x, label, f_len, y_len = _loss_inputs(triton_device)
    variants = [{}, dict(blank=0), dict(blank=3), dict(blank=6), dict(blank=-1), dict(blank=True), dict(opt=0),
                dict(opt=2), dict(fused=False), dict(rg=False), dict(blank=2, fused=False), {}]
    with apex.backend("triton"):
        for kw in variants:
            _loss("module", x, label, f_len, y_len)  # warm
            lean = _outcome(lambda kw=kw: _loss("module", x, label, f_len, y_len, **kw))
            with _general(monkeypatch):
                general = _outcome(lambda kw=kw: _loss("module", x, label, f_len, y_len, **kw))
            _same(lean, general)
        with torch.no_grad():
            _same(*_loss_both(monkeypatch, "module", x, label, f_len, y_len))


def test_loss_errors_after_a_warm_call(triton_device, monkeypatch):
    x, label, f_len, y_len = _loss_inputs(triton_device)
    cases = [dict(label=label.float()), dict(x=x[0]), dict(f_len=f_len[:2]), dict(y_len=y_len.float()),
             dict(x=x.int()), dict(label=label[:, :1].expand(3, 3)), dict(x=x[:2])]
    with apex.backend("triton"):
        for kw in cases:
            _loss("function", x, label, f_len, y_len)  # warm: the plan of the good call
            args = {"x": x, "label": label, "f_len": f_len, "y_len": y_len, **kw}
            lean = _outcome(lambda a=args: [TL.transducer_loss(**a, blank_idx=5)])
            with _general(monkeypatch):
                general = _outcome(lambda a=args: [TL.transducer_loss(**a, blank_idx=5)])
            _same(lean, general)


def test_loss_inplace_change_of_a_saved_label_is_an_error(triton_device, monkeypatch):
    x, label, f_len, y_len = _loss_inputs(triton_device)
    errors = []
    with apex.backend("triton"):
        for ctx in (contextlib.nullcontext(), _general(monkeypatch)):
            with ctx:
                lab = label.clone()
                loss = TL.transducer_loss(_leaf(x, True), lab, f_len, y_len, 5)
                lab.add_(0)
                errors.append(_outcome(lambda loss=loss: loss.sum().backward()))
    assert errors[0][0] is RuntimeError and "modified by an inplace operation" in errors[0][1]
    assert errors[0] == errors[1]


@pytest.mark.no_triton_launch("launches recorded, not run")
def test_loss_launches_as_the_general_path(triton_device, monkeypatch):
    from apex._kernels import transducer_loss as K

    with apex.backend("triton"):
        for dtype, layout in ((F32, "strided"), (torch.float16, "contiguous")):
            x, label, f_len, y_len = _loss_inputs(triton_device, dtype, I64, layout)
            seen = []
            for ctx in (contextlib.nullcontext(), _general(monkeypatch)):
                with ctx, monkeypatch.context() as m:
                    launches = record_launches(m, [K._row_lse, K._alpha_beta, K._grad])
                    _loss("module", x, label, f_len, y_len, blank=2)
                    seen.append(launches)
            assert len(seen[0]) == 3 and seen[0] == seen[1]


def test_other_backends_and_subclasses_take_the_general_path(triton_device, monkeypatch):
    """The PyTorch backend, a tensor subclass: the lean entries answer None (nothing planned)."""
    f, g, f_len, g_len = _joint_inputs(triton_device)
    x, label, fl, yl = _loss_inputs(triton_device)
    with apex.backend("torch"):
        assert TJ._lean(f, g, f_len, g_len, False, False, 0.0, 4, None) is None
        assert TL._lean(x, label, fl, yl, 5, True, None, 1) is None

    class Sub(torch.Tensor):
        pass

    with apex.backend("triton"):
        assert TJ._lean(f.as_subclass(Sub), g, f_len, g_len, False, False, 0.0, 4, None) is None
        assert TL._lean(x.as_subclass(Sub), label, fl, yl, 5, True, None, 1) is None
        TJ.transducer_joint(f, g, f_len, g_len)  # (a launch: this test takes the Triton path too)
