"""The transducer joint's and loss's Triton backwards under a saved-tensor hook that gives their saved tensors back
in another layout (an offloading or compressing hook may): the kernels read the mask, the lattices and the labels
as contiguous tensors, so the backward must hand them such, on the lean path and on the general one alike."""

import contextlib

import pytest
import torch

import apex
from apex.contrib.transducer import TransducerJoint, TransducerLoss
from apex.contrib.transducer import transducer as M
from apex.ops import transducer_joint as TJ
from apex.ops import transducer_loss as TL
from tests._layouts import column_major as _column_major


@contextlib.contextmanager
def _path(monkeypatch, path):
    with monkeypatch.context() as m:
        if path == "general":  # the lean entries switched off where the ops and the modules call them
            for owner, name in ((TJ, "_lean"), (TL, "_lean"), (M, "_joint_lean"), (M, "_loss_lean")):
                m.setattr(owner, name, lambda *a: None)
        yield


def _grads(fn, leaves, hook):
    with torch.autograd.graph.saved_tensors_hooks(hook or (lambda t: t), lambda t: t):
        out = fn()
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


@pytest.mark.parametrize("path", ["lean", "general"])
@pytest.mark.parametrize("relu", [False, True])
def test_joint_backward_under_a_relayout_hook(triton_device, monkeypatch, path, relu):
    torch.manual_seed(0)
    f = torch.randn(2, 5, 8, requires_grad=True)
    g = torch.randn(2, 4, 8, requires_grad=True)
    f_len, g_len = torch.tensor([5, 3], dtype=torch.int32), torch.tensor([4, 2], dtype=torch.int32)
    joint = TransducerJoint(relu=relu)
    with _path(monkeypatch, path), apex.backend("triton"):
        ref = _grads(lambda: joint(f, g, f_len, g_len), (f, g), None)
        got = _grads(lambda: joint(f, g, f_len, g_len), (f, g), _column_major)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("path", ["lean", "general"])
def test_loss_backward_under_a_relayout_hook(triton_device, monkeypatch, path):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 4, 6, requires_grad=True)
    label = torch.randint(1, 6, (2, 3))
    f_len, y_len = torch.tensor([5, 3], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    loss = TransducerLoss()
    with _path(monkeypatch, path), apex.backend("triton"):
        ref = _grads(lambda: loss(x, label, f_len, y_len, 0), (x,), None)
        got = _grads(lambda: loss(x, label, f_len, y_len, 0), (x,), _column_major)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
