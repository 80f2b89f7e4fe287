"""The norms' general eager backward (the ``_Direct`` Functions of ``layer_norm``, ``rms_norm`` and the fused
add + norm) under a saved-tensor hook that gives the saved input or output back in another layout: the backward
must read the tensor it got, not the layout the forward recorded. ``save_on_cpu`` does this to a strided input
(its copy is dense), and an offloading or compressing hook may return any layout. The lean paths' own checks are
tested in ``test_norm_lean.py``; these call the general entries directly."""

import pytest
import torch

import apex
from apex.ops.fused_add_norm import _fused_add
from apex.ops.layer_norm import layer_norm_general
from apex.ops.rms_norm import rms_norm_general
from tests._layouts import column_major, dense

N = 12


HOOKS = {"dense copy": dense, "column-major copy": column_major}


def _grads(call, leaves, hook):
    out = call()
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.device)
    if hook is None:
        return torch.autograd.grad(out, leaves, dy)
    with torch.autograd.graph.saved_tensors_hooks(hook, lambda t: t):
        out = call()
    return torch.autograd.grad(out, leaves, dy)


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("sliced", [False, True])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_general_backward_reads_the_saved_tensor_it_gets(triton_device, op, sliced, memory_efficient, hook):
    # A sliced input (row stride 2N) is its own rows: the forward records that stride for the backward.
    base = torch.randn(5, 2 * N if sliced else N, device=triton_device, requires_grad=True)
    w = torch.randn(N, device=triton_device, requires_grad=True)
    b = torch.randn(N, device=triton_device, requires_grad=True)

    def call():
        x = base[:, :N]
        if op == "layer_norm":
            return layer_norm_general(x, (N,), w, b, 1e-5, memory_efficient, None)
        return rms_norm_general(x, (N,), w, 1e-5, memory_efficient, None)

    leaves = (base, w, b) if op == "layer_norm" else (base, w)
    with apex.backend("triton"):
        ref = _grads(call, leaves, None)
        got = _grads(call, leaves, HOOKS[hook])
    for r, g in zip(ref, got):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("is_rms", [True, False])
def test_fused_add_general_backward_reads_the_saved_tensor_it_gets(triton_device, is_rms, memory_efficient, hook):
    x = torch.randn(5, N, device=triton_device, requires_grad=True)
    r = torch.randn(5, N, device=triton_device, requires_grad=True)
    w = torch.randn(N, device=triton_device, requires_grad=True)
    b = None if is_rms else torch.randn(N, device=triton_device, requires_grad=True)

    def call():
        return _fused_add(x, r, w, b, (N,), 1e-5, is_rms, memory_efficient)[0]

    leaves = (x, r, w) if is_rms else (x, r, w, b)
    with apex.backend("triton"):
        ref = _grads(call, leaves, None)
        got = _grads(call, leaves, HOOKS[hook])
    for a, g in zip(ref, got):
        torch.testing.assert_close(g, a, rtol=1e-5, atol=1e-5)
