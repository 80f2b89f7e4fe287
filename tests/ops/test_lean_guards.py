"""The planned eager paths' guard (apex.ops._lean.refresh_guard): a call whose tensors have the last call's exact
metadata and whose options are the last call's takes the last plan without building its key; a call that differs
in any tensor fact (strides, dtype, requires_grad) or option takes its key, and every call gives the general
path's bits. (The norms' own cases: tests/ops/test_norm_lean.py.)"""

from __future__ import annotations

import pytest
import torch

import apex
from apex.ops import bias_gelu as BG
from apex.ops import bias_swiglu as BS
from apex.ops import fused_rope as FR
from apex.ops import group_norm as GN
from apex.ops import index_mul_2d as IM
from apex.ops import scaled_masked_softmax as SM
from apex.ops import xentropy as XE
from tests import _device
from tests.ops._lean import same_run

pytestmark = pytest.mark.skipif(_device.requested() == "meta", reason="APEX_TEST_DEVICE=meta runs the apex ops "
                                "under a dispatch mode, which takes the registered op by design")


class _CountingKey(tuple):
    """A plan's key that counts the comparisons a keyed lookup makes with it (a guarded call makes none)."""

    compared = 0

    def __ne__(self, other):
        _CountingKey.compared += 1
        return tuple.__ne__(self, other)

    def __eq__(self, other):
        _CountingKey.compared += 1
        return tuple.__eq__(self, other)

    __hash__ = tuple.__hash__


def _r(*shape, dev, rg=True, dtype=torch.float32):
    return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(rg)


# op: (module, call(*tensors, option), tensors(dev, rg, dtype), option, another option or None)
CASES = {
    "bias_gelu": (BG, lambda x, b, o: BG.bias_gelu(x, b), lambda d, rg, dt: (_r(4, 8, dev=d, rg=rg, dtype=dt),
                                                                               _r(8, dev=d, rg=rg, dtype=dt)), 0, None),
    "bias_swiglu": (BS, lambda x, b, o: BS.bias_swiglu(x, b),
                    lambda d, rg, dt: (_r(4, 8, dev=d, rg=rg, dtype=dt), _r(8, dev=d, rg=rg, dtype=dt)), 0, None),
    "softmax": (SM, lambda x, m, o: SM.scaled_masked_softmax(x, m, 0.5, o),
                lambda d, rg, dt: (_r(1, 2, 4, 4, dev=d, rg=rg, dtype=dt),
                                   torch.rand(1, 1, 4, 4, device=d) > 0.7), False, True),
    "index_mul_2d": (IM, lambda a, b, i, o: IM.index_mul_2d(a, b, i),
                     lambda d, rg, dt: (_r(5, 8, dev=d, rg=rg, dtype=dt), _r(3, 8, dev=d, rg=rg, dtype=dt),
                                        torch.tensor([4, 0, 2], device=d)), 0, None),
    "fused_rope": (FR, lambda t, f, o: FR.fused_rope(t, f, o),
                   lambda d, rg, dt: (_r(4, 1, 2, 8, dev=d, rg=rg, dtype=dt), torch.randn(4, 1, 1, 8, device=d)),
                   False, True),
    "xentropy": (XE, lambda x, y, o: XE.SoftmaxCrossEntropyLoss.apply(x, y, o, 0, False),
                 lambda d, rg, dt: (_r(4, 8, dev=d, rg=rg, dtype=dt), torch.tensor([1, 0, 7, 3], device=d)), 0.1,
                 0.2),
    "group_norm": (GN, lambda x, w, b, o: GN.group_norm(x, o, w, b, 1e-5),
                   lambda d, rg, dt: (_r(2, 4, 3, 3, dev=d, rg=rg, dtype=dt), _r(4, dev=d, rg=rg),
                                      _r(4, dev=d, rg=rg)), 2, 4),
}


def _run(call, tensors, option, dy_seed=0):
    out = call(*tensors, option)
    leaves = [t for t in tensors if t.requires_grad]
    if not (leaves and out.requires_grad):
        return out, []
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(dy_seed)).to(out.device, out.dtype)
    return out, list(torch.autograd.grad(out, leaves, dy))


def _leaves(tensors):
    return tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in tensors)


@pytest.mark.parametrize("op", CASES)
def test_the_last_plan_is_taken_on_its_guard_and_any_difference_takes_the_key(triton_device, monkeypatch, op):
    mod, call, make, option, other = CASES[op]
    dev = triton_device

    def check(tensors, opt, guarded):
        _CountingKey.compared = 0
        lean = _run(call, _leaves(tensors), opt)
        assert (_CountingKey.compared == 0) == guarded, (_CountingKey.compared, guarded)
        with monkeypatch.context() as m:
            m.setattr(mod, "_lean", lambda *args: None)
            general = _run(call, _leaves(tensors), opt)
        same_run(lean, general)

    with apex.backend("triton"):
        for _ in range(2):
            call(*make(dev, True, torch.float32), option)
        plan = mod._lean.__self__.table.last[0]
        assert plan, f"{op}: not planned"
        plan.key = _CountingKey(plan.key)  # (the table maps the plain key to it: a keyed hit compares it)
        check(make(dev, True, torch.float32), option, True)  # new tensors, the same facts: the guard
        check(make(dev, True, torch.float16), option, False)  # another dtype: the key (another plan)
        plan = mod._lean.__self__.table.last[0]
        plan.key = _CountingKey(plan.key)
        check(make(dev, True, torch.float16), option, True)
        check(make(dev, False, torch.float16), option, False)  # no gradients: a second guard of the plan...
        check(make(dev, True, torch.float16), option, True)  # ...and both kept
        check(make(dev, False, torch.float16), option, True)
        if other is not None:
            check(make(dev, True, torch.float16), other, False)
