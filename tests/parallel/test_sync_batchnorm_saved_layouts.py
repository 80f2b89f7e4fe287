"""SyncBatchNorm's Triton backward under a saved-tensor hook that gives the saved input, residual and statistics
back in another layout (an offloading or compressing hook may): the kernels read them as the forward made them,
contiguous, so the backward must hand them such, on the lean path and on the general one alike."""

import contextlib

import pytest
import torch

import apex
from apex.parallel import SyncBatchNorm
from apex.parallel import sync_batchnorm as S
from tests._layouts import column_major as _column_major


@contextlib.contextmanager
def _path(monkeypatch, path):
    with monkeypatch.context() as m:
        if path == "general":  # the module's lean entry switched off
            m.setattr(S, "_direct_forward", lambda *a: None)
        yield


@pytest.mark.parametrize("path", ["lean", "general"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("channel_last", [False, True])
def test_backward_under_a_relayout_hook(triton_device, monkeypatch, path, residual, channel_last):
    torch.manual_seed(0)
    shape = (3, 5, 4) if channel_last else (3, 4, 5)
    mod = SyncBatchNorm(4, channel_last=channel_last, fuse_relu=residual)
    x = torch.randn(shape, requires_grad=True)
    z = torch.randn(shape, requires_grad=True) if residual else None
    leaves = (x, z, mod.weight, mod.bias) if residual else (x, mod.weight, mod.bias)

    def grads(hook):
        with torch.autograd.graph.saved_tensors_hooks(hook or (lambda t: t), lambda t: t):
            y = mod(x, z) if residual else mod(x)
        dy = torch.arange(y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape).sin()
        return torch.autograd.grad(y, leaves, dy)

    with _path(monkeypatch, path), apex.backend("triton"):
        ref, got = grads(None), grads(_column_major)
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
