"""apex.transformer.functional's softmax functions try the op's planned eager path (apex.ops._softmax_direct)
before their own checks: a warm call runs no check of theirs and no general path, gives the general path's bits,
and every bad call raises what it raised before, in the same order, whether or not a nearby layout is planned."""

from __future__ import annotations

import pytest
import torch

import apex
from apex._errors import AssertValueError, RuntimeTypeError, RuntimeValueError
from apex.ops import scaled_masked_softmax as S
from apex.transformer.functional import fused_softmax as FS
from tests import _device

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")


def _general_only(monkeypatch):
    """Every check and general path these functions or the op could take raises: only a plan hit returns."""
    def refuse(*args, **kwargs):
        raise AssertionError("the general path was taken")

    for owner, name in ((FS, "_check_4d"), (FS, "_autocast"), (S, "check_args"), (S, "_run"),
                        (S, "scaled_masked_softmax"), (S, "scaled_masked_softmax_checked")):
        monkeypatch.setattr(owner, name, refuse)


def _calls():
    """(name, f(x, mask)) of every functional entry, the causal one with its ignored second argument."""
    return [("causal", lambda x, m: FS.scaled_upper_triang_masked_softmax(x, m, 0.37)),
            ("masked", lambda x, m: FS.scaled_masked_softmax(x, m, 0.37)),
            ("generic", lambda x, m: FS.generic_scaled_masked_softmax(x, m, 0.37)),
            ("softmax", lambda x, m: FS.scaled_softmax(x, 0.37))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("masked", [False, True])
def test_a_warm_call_takes_the_plan_and_nothing_else(triton_device, monkeypatch, dtype, masked):
    dev = triton_device
    mask = (torch.rand(2, 1, 6, 6, device=dev) < 0.3) if masked else None
    dy = torch.randn(2, 3, 6, 6, device=dev).to(dtype)
    with apex.backend("triton"):
        for name, call in _calls():
            m = None if name in ("causal", "softmax") else mask
            x = torch.randn(2, 3, 6, 6, device=dev).to(dtype).requires_grad_()
            with monkeypatch.context() as p:  # the general path's result: the plan lookup off
                p.setattr(S, "_lean", lambda *args: None)
                ref_y = call(x, m)
                ref_dx, = torch.autograd.grad(ref_y, x, dy)
            call(x, m)  # (plans the layout)
            with monkeypatch.context() as p:
                _general_only(p)
                y = call(x, m)
                assert type(y.grad_fn).__name__ == "_DirectSoftmaxBackward", name
                dx, = torch.autograd.grad(y, x, dy)
                with torch.no_grad():
                    y0 = call(x, m)
            assert y.dtype == dtype and dx.dtype == dtype
            torch.testing.assert_close(y, ref_y, rtol=0, atol=0)
            torch.testing.assert_close(y0, ref_y, rtol=0, atol=0)
            torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0)


def test_a_miss_looks_the_plan_up_once(monkeypatch):
    """Another backend (no plan runs): the functions' checks and the op's general path, the lookup made once."""
    seen = []
    lean = S._lean
    monkeypatch.setattr(S, "_lean", lambda *args: seen.append(args[0].shape) or lean(*args))
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 5, 5) < 0.3
    with apex.backend("torch"):
        for name, call in _calls():
            m = None if name in ("causal", "softmax") else mask
            ref = S.scaled_masked_softmax_forward(x.detach(), m, 0.37, name == "causal")
            seen.clear()
            y = call(x, m)
            assert len(seen) == 1, name
            torch.testing.assert_close(y, ref, rtol=0, atol=0)
            torch.autograd.grad(y, x, torch.ones_like(y))


def _raised(fn) -> tuple[type, str]:
    with pytest.raises(Exception) as info:
        fn()
    return type(info.value), str(info.value)


def _warm(dev):
    """Plans near every bad call below (the op's own entry, which plans 3-D scores and non-4-D masks too), so
    that a hit would answer for a call the functions refuse."""
    for shape in ((6, 5, 5), (2, 3, 5, 5), (2, 3, 5, 7)):
        S.scaled_masked_softmax(torch.randn(shape, device=dev), None, 0.5, True if shape[-1] == 5 else False)
    S.scaled_masked_softmax(torch.randn(2, 3, 5, 5, device=dev), torch.rand(5, 5, device=dev) < 0.3, 0.5)


def test_bad_causal_calls_raise_as_before_cold_and_warm(triton_device):
    dev = triton_device
    f = FS.scaled_upper_triang_masked_softmax
    ok = torch.randn(2, 3, 5, 5, device=dev)
    cases = [
        # (call, error class, message start): the functions' checks first, in their order.
        (lambda: f(torch.randn(6, 5, 5, device=dev), None, 0.5), RuntimeValueError,
         "inputs must be a 4-D [b, np, sq, sk] tensor of attention scores, got shape [6, 5, 5]"),
        (lambda: f(torch.zeros(6, 5, 7, dtype=torch.int64, device=dev), None, 0.5), RuntimeValueError,
         "inputs must be a 4-D"),
        (lambda: f(torch.randn(1, 2, 3, 5, 5, device=dev), None, 0.5), RuntimeValueError, "inputs must be a 4-D"),
        (lambda: f(torch.randn(2, 3, 5, 7, device=dev), None, 0.5), AssertValueError,
         "causal mask is only for self attention: inputs must have sq == sk, got shape [2, 3, 5, 7]"),
        (lambda: f(torch.zeros(2, 3, 5, 7, dtype=torch.int64, device=dev), None, 0.5), AssertValueError,
         "causal mask is only for self attention"),
        (lambda: f(torch.zeros(2, 3, 5, 5, dtype=torch.int64, device=dev), None, 0.5), RuntimeTypeError,
         "inputs must be a floating-point tensor"),
        (lambda: f(torch.zeros(2, 3, 5, 5, dtype=torch.bool, device=dev), None, 0.5), RuntimeTypeError,
         "inputs must be a floating-point tensor"),
        (lambda: f([[1.0]], None, 0.5), TypeError, "inputs must be a torch.Tensor, got list"),
        (lambda: f(ok, None, "0.5"), TypeError, "scale must be a real number"),
        (lambda: f(ok, None, True), TypeError, "scale must be a real number"),
        (lambda: f(ok.requires_grad_(), None, torch.ones(2)), TypeError, "scale must be a real number"),
    ]
    with apex.backend("triton"):
        for warm in (False, True, True):  # (cold only for the layouts no test planned yet)
            if warm:
                _warm(dev)
            for call, cls, start in cases:
                got = _raised(call)
                assert got[0] is cls and got[1].startswith(start), (warm, got)
        # A refused call planned nothing that a call checking less would take: the op still refuses.
        with pytest.raises(RuntimeTypeError, match="input must be a floating-point tensor"):
            S.scaled_masked_softmax(torch.zeros(2, 3, 5, 5, dtype=torch.int64, device=dev), None, 0.5, True)
        with pytest.raises(RuntimeValueError, match="needs sq == sk"):
            S.scaled_masked_softmax(torch.randn(2, 3, 5, 7, device=dev), None, 0.5, True)
        torch.testing.assert_close(f(ok.detach(), None, 0.5), S.scaled_masked_softmax_forward(ok, None, 0.5, True))


def test_bad_masked_calls_raise_as_before_cold_and_warm(triton_device):
    dev = triton_device
    ok, mask = torch.randn(2, 3, 5, 5, device=dev), torch.rand(2, 1, 5, 5, device=dev) < 0.3
    cases = []
    for f in (FS.scaled_masked_softmax, FS.generic_scaled_masked_softmax):
        cases += [
            (lambda f=f: f(torch.randn(6, 5, 5, device=dev), None, 0.5), RuntimeValueError,
             "inputs must be a 4-D [b, np, sq, sk] tensor of attention scores, got shape [6, 5, 5]"),
            (lambda f=f: f(torch.randn(6, 5, 5, device=dev), "mask", 0.5), RuntimeValueError, "inputs must be a 4-D"),
            # The op's checks (its argument name: input), as the functions called it.
            (lambda f=f: f(torch.zeros(2, 3, 5, 5, dtype=torch.int64, device=dev), mask, 0.5), RuntimeTypeError,
             "input must be a floating-point tensor"),
            (lambda f=f: f("x", mask, 0.5), TypeError, "input must be a torch.Tensor, got str"),
            (lambda f=f: f(ok, mask.float(), 0.5), TypeError, "mask must be a bool (or uint8) tensor"),
            (lambda f=f: f(ok, [[True]], 0.5), TypeError, "mask must be a torch.Tensor or None, got list"),
            (lambda f=f: f(ok, torch.rand(2, 1, 5, 4, device=dev) < 0.3, 0.5), RuntimeValueError,
             "mask of shape [2, 1, 5, 4] does not broadcast"),
            (lambda f=f: f(ok, torch.ones(2, 1, 5, 5, dtype=torch.bool, device="meta"), 0.5), ValueError,
             "mask is on meta"),
            (lambda f=f: f(ok, mask, "0.5"), TypeError, "scale must be a real number"),
        ]
    cases.append((lambda: FS.scaled_softmax(torch.randn(6, 5, 5, device=dev), 0.5), RuntimeValueError,
                  "inputs must be a 4-D"))
    cases.append((lambda: FS.scaled_softmax(ok, None), TypeError, "scale must be a real number"))
    with apex.backend("triton"):
        for warm in (False, True, True):
            if warm:
                _warm(dev)
                FS.scaled_masked_softmax(ok, mask, 0.5)
            for call, cls, start in cases:
                got = _raised(call)
                assert got[0] is cls and got[1].startswith(start), (warm, got)
        torch.testing.assert_close(FS.scaled_masked_softmax(ok, mask, 0.5),
                                   S.scaled_masked_softmax_forward(ok, mask, 0.5))


def test_autocast_casts_before_any_plan(triton_device, monkeypatch):
    """Under autocast the scores are cast first: no plan is looked up for the uncast ones."""
    dev = triton_device
    seen = []
    lean = S._lean
    monkeypatch.setattr(S, "_lean", lambda *args: seen.append(args[0].dtype) or lean(*args))
    x = torch.randn(2, 3, 5, 5, device=dev)
    mask = torch.rand(2, 1, 5, 5, device=dev) < 0.3
    with apex.backend("triton"):
        for call in (lambda: FS.scaled_upper_triang_masked_softmax(x, None, 0.5),
                     lambda: FS.scaled_masked_softmax(x, mask, 0.5)):
            call()  # (planned for fp32 scores)
            seen.clear()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                y = call()
            assert y.dtype == torch.bfloat16 and seen == [torch.bfloat16]


def test_a_subclass_takes_the_general_path(triton_device):
    class Scores(torch.Tensor):
        pass

    dev = triton_device
    x = torch.randn(2, 3, 5, 5, device=dev)
    with apex.backend("triton"):
        for call in (lambda t: FS.scaled_upper_triang_masked_softmax(t, None, 0.5),
                     lambda t: FS.scaled_masked_softmax(t, None, 0.5)):
            torch.testing.assert_close(call(x.as_subclass(Scores)).as_subclass(torch.Tensor), call(x),
                                       rtol=0, atol=0)
