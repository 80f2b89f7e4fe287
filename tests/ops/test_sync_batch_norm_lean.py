"""SyncBatchNorm's lean eager path after a warm call: a repeat call takes the plan its module took last where the
call's options equal the plan's and its tensors pass the plan's guard, without building a key
(``apex.parallel._syncbn_direct``, ``apex.ops._syncbn_direct``). Every call whose facts changed since (a
parameter's or buffer's data replaced, the mode, the options, requires_grad, the input's layout) must give what
the general path gives, bit for bit, or its error; and the plan must be taken without a key where nothing changed.
"""

from __future__ import annotations

import copy

import pytest
import torch

import apex
import apex.parallel._syncbn_direct as lean_mod
from apex.parallel import SyncBatchNorm
from tests.parallel.test_sync_batchnorm_direct import _general


@pytest.fixture
def keys(monkeypatch, triton_device):
    """The calls that built a key (``lookup``), on the Triton path: a repeat call that takes its module's plan
    from the guard builds none."""
    built = []
    lookup = lean_mod._lookup

    def counting(*args):
        built.append(args[0].shape)
        return lookup(*args)

    monkeypatch.setattr(lean_mod, "_lookup", counting)
    with apex.backend("triton"):
        yield built


def _step(bn, x, z=None):
    """One call and the gradients autograd gives (of the input, z, weight, bias where they need one), with the
    running statistics and counter after it; an error's type and message instead where the call raises."""
    try:
        y = bn(x, z)
    except Exception as e:  # noqa: BLE001 (the error is the result)
        return [type(e), str(e)]
    wrt = [t for t in (x, z, bn.weight, bn.bias) if t is not None and t.requires_grad]
    grads = list(torch.autograd.grad(y, wrt, torch.ones_like(y))) if wrt and y.requires_grad else []
    stats = [t.clone() if isinstance(t, torch.Tensor) else t for t in (bn.running_mean, bn.running_var,
                                                                     bn.num_batches_tracked)]
    return [y.detach(), y.requires_grad, *grads, *stats]


def _assert_same(a, b):
    assert len(a) == len(b), (a, b)
    for i, (u, v) in enumerate(zip(a, b)):
        if isinstance(u, torch.Tensor):
            assert isinstance(v, torch.Tensor), i
            assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride(), i
            assert torch.equal(u, v), f"result {i} differs"
        else:
            assert u == v, (i, u, v)


class _Pair:
    """A module and its twin (a deep copy) called on the general path: each call is compared."""

    def __init__(self, bn, device):
        self.bn, self.twin, self.device = bn.to(device), copy.deepcopy(bn).to(device), device

    def both(self, x, z=None, fix=None):
        """Calls both on ``x`` (cloned for each, ``requires_grad`` kept) after ``fix(module)`` on each."""
        for m in (self.bn, self.twin):
            if fix is not None:
                fix(m)

        def inputs():
            xi = x.detach().clone(memory_format=torch.preserve_format).requires_grad_(x.requires_grad)
            zi = None if z is None else z.detach().clone().requires_grad_(z.requires_grad)
            return xi, zi

        ours = _step(self.bn, *inputs())
        _assert_same(ours, _general(lambda: _step(self.twin, *inputs())))
        return ours


def _x(*shape, device, grad=True):
    return (torch.randn(*shape, device=device) * 2 + 1).requires_grad_(grad)


def test_a_repeat_call_takes_the_plan_without_a_key(keys, triton_device):
    pair = _Pair(SyncBatchNorm(6), triton_device)
    for _ in range(3):
        pair.both(_x(4, 6, 5, device=triton_device))
    assert len(keys) == 1  # (the first call's; the others passed its guard)
    with torch.no_grad():
        pair.both(_x(4, 6, 5, device=triton_device))
    pair.both(_x(4, 6, 5, device=triton_device))
    assert len(keys) == 1


def test_parameter_and_buffer_data_replaced(keys, triton_device):
    """``param.data = other`` keeps the parameter (the same object) with other facts: each such call is the general
    path's, bit for bit (a strided parameter or buffer takes PyTorch's operators), never the stale plan's."""
    dev = triton_device
    pair = _Pair(SyncBatchNorm(4), dev)
    x = _x(6, 4, 3, device=dev)
    pair.both(x)
    for m in (pair.bn, pair.twin):  # strided in place: the kernels cannot read it as it is
        m.weight.data = torch.linspace(0.5, 2.0, 8, device=dev)[::2]
    pair.both(x)
    for m in (pair.bn, pair.twin):  # contiguous again, another dtype
        m.weight.data = torch.linspace(0.5, 2.0, 4, device=dev).half()
    pair.both(x)
    for m in (pair.bn, pair.twin):  # a strided running variance (a buffer's data replaced)
        m.running_var.data = torch.linspace(1.0, 2.0, 8, device=dev)[::2]
    pair.both(x)
    for m in (pair.bn, pair.twin):  # a buffer replaced by another tensor
        m.running_var = torch.ones(4, device=dev)
    pair.both(x)
    pair.both(x)
    assert len(keys) >= 4  # (each changed call built its key)


def test_mode_and_options_changed_after_warm_calls(keys, triton_device):
    """eval/train, momentum (a number, None, 0), eps, fuse_relu, channel_last and num_features changed on a warm
    module: each call equals the general path's (or raises its error)."""
    dev = triton_device
    pair = _Pair(SyncBatchNorm(5, channel_last=True), dev)  # channel-last: eval calls take the kernels too
    x = _x(3, 4, 5, device=dev)
    pair.both(x)
    pair.both(x, fix=lambda m: m.eval())
    pair.both(x)
    pair.both(x, fix=lambda m: m.train())
    pair.both(x, fix=lambda m: setattr(m, "momentum", None))
    pair.both(x)
    pair.both(x, fix=lambda m: setattr(m, "momentum", 0.0))
    pair.both(x, fix=lambda m: setattr(m, "eps", 0.5))
    pair.both(x, fix=lambda m: setattr(m, "fuse_relu", True))
    pair.both(x, fix=lambda m: setattr(m, "track_running_stats", False))
    pair.both(x, fix=lambda m: m.eval())
    pair.both(x, fix=lambda m: (setattr(m, "track_running_stats", True), m.train()))
    # The same input shape read channel-first: C is dimension 1 (4 channels, not 5): the general path's error.
    out = pair.both(x, fix=lambda m: setattr(m, "channel_last", False))
    assert out[0] is ValueError
    out = pair.both(x, fix=lambda m: (setattr(m, "channel_last", True), setattr(m, "num_features", 6)))
    assert out[0] is ValueError  # (5 channels last again, but num_features is 6)
    pair.both(x, fix=lambda m: setattr(m, "num_features", 5))


def test_requires_grad_toggled(keys, triton_device):
    dev = triton_device
    pair = _Pair(SyncBatchNorm(4), dev)
    pair.both(_x(5, 4, 3, device=dev))
    pair.both(_x(5, 4, 3, device=dev, grad=False))
    for m in (pair.bn, pair.twin):
        m.weight.requires_grad_(False)
    pair.both(_x(5, 4, 3, device=dev))
    for m in (pair.bn, pair.twin):
        m.bias.requires_grad_(False)
    out = pair.both(_x(5, 4, 3, device=dev, grad=False))
    assert out[1] is False  # (nothing needs a gradient: no graph)
    for m in (pair.bn, pair.twin):
        m.weight.requires_grad_(True)
        m.bias.requires_grad_(True)
    pair.both(_x(5, 4, 3, device=dev))


def test_input_layout_changed_on_the_same_shape(keys, triton_device):
    """Channels-last and strided inputs of a warm plan's shape: the kernels read a contiguous copy (or the general
    path's), never the input's memory as the contiguous plan would."""
    dev = triton_device
    pair = _Pair(SyncBatchNorm(3), dev)
    x = _x(2, 3, 4, 5, device=dev)
    pair.both(x)
    last = x.detach().to(memory_format=torch.channels_last).requires_grad_()
    pair.both(last)
    pair.both(x)
    strided = _x(2, 3, 4, 10, device=dev)[..., ::2].detach().requires_grad_()
    pair.both(strided)
    pair.both(strided)
    pair.both(x)


def test_residual_given_then_not(keys, triton_device):
    dev = triton_device
    pair = _Pair(SyncBatchNorm(4, fuse_relu=True), dev)
    x = _x(3, 4, 6, device=dev)
    pair.both(x, _x(3, 4, 6, device=dev))
    pair.both(x)
    pair.both(x, _x(3, 4, 6, device=dev, grad=False))
    pair.both(x, _x(3, 4, 12, device=dev)[..., ::2])  # strided z
    pair.both(x, _x(3, 4, 6, device=dev).half())  # another dtype (converted for the kernels)
    pair.both(x)


def test_modules_of_different_shapes_alternate(keys, triton_device):
    """Each module takes its own plan on repeat calls (a model's layers), each equal to the general path's."""
    dev = triton_device
    pairs = [_Pair(SyncBatchNorm(c), dev) for c in (3, 5, 3)]
    xs = [_x(4, 3, 7, device=dev), _x(2, 5, 3, 3, device=dev), _x(6, 3, device=dev)]
    for _ in range(3):
        for pair, x in zip(pairs, xs):
            pair.both(x)
    assert len(keys) == 3


def test_a_class_whose_attribute_is_a_property(keys, triton_device):
    """A subclass that defines one of the state's names as a property: the property's value, as the general path
    reads it, not an entry of the instance's ``__dict__`` of that name."""

    class Scaled(SyncBatchNorm):
        @property
        def eps(self):
            return 0.25

        @eps.setter
        def eps(self, value):
            pass

    dev = triton_device
    pair = _Pair(Scaled(4), dev)
    for m in (pair.bn, pair.twin):
        m.__dict__["eps"] = 1e-5  # (what a __dict__ read would take)
    x = _x(5, 4, 3, device=dev)
    y = pair.both(x)[0]
    assert torch.allclose(y.var(dim=(0, 2), unbiased=False), torch.full((4,), 1.0, device=dev) * (
        x.detach().var(dim=(0, 2), unbiased=False) / (x.detach().var(dim=(0, 2), unbiased=False) + 0.25)),
        rtol=1e-3)


def test_deleted_or_replaced_attributes(keys, triton_device):
    """An attribute deleted from a warm module: the general path's lookup and error, each time."""
    dev = triton_device
    pair = _Pair(SyncBatchNorm(4), dev)
    x = _x(5, 4, 3, device=dev)
    pair.both(x)
    for m in (pair.bn, pair.twin):
        del m.fuse_relu
    for _ in range(2):
        out = pair.both(x)
        assert out[0] is AttributeError
    for m in (pair.bn, pair.twin):
        m.fuse_relu = True
    pair.both(x)
    for m in (pair.bn, pair.twin):  # the counter gone: the general path's error, each time
        m.num_batches_tracked = None
    for _ in range(2):
        pair.both(x)


def test_a_new_module_at_a_reused_address(keys, triton_device):
    """The plan a module took is a hint by its id: a module made after another was freed may have its id; its
    call is checked as any other (another shape here), and equals the general path's."""
    dev = triton_device
    for length in (2, 5, 2, 7):  # (the same options: only the guard tells the layouts apart)
        pair = _Pair(SyncBatchNorm(3), dev)
        pair.both(_x(4, 3, length, device=dev))
        pair.both(_x(4, 3, length, device=dev))
        del pair
