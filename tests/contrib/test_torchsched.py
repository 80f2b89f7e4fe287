"""``apex.contrib.torchsched``: the registered ``"torchsched"`` backend compiles on CPU and matches eager;
its layer-norm operator and pre-grad pass against float64 references."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo import list_backends

import apex.contrib.torchsched as ts
from apex.contrib.torchsched import config
from apex.contrib.torchsched.backend import (
    DecompositionsWrapper,
    _conv_backward_split,
    convolution_backward_decomp_dwb,
    get_backend,
)
from apex.contrib.torchsched.passes.pre_grad_passes import replace_layer_norm
from apex.testing import assert_rel_close, rand


@pytest.fixture
def one_compile_thread():
    import torch._inductor.config as inductor_config

    # No subprocess pool of compile workers on the shared 2-core test machine. The config module's own
    # patch(), not monkeypatch: pytest >= 9.2 undoes a setattr on a module whose attributes live outside its
    # __dict__ with a delattr, which deletes the option for every later test.
    with inductor_config.patch(compile_threads=1):
        yield


def test_backend_is_registered():
    assert "torchsched" in list_backends(exclude_tags=())
    assert isinstance(get_backend("torchsched", "wbd"), DecompositionsWrapper)
    assert get_backend("torchsched") == get_backend("torchsched", "dwb")
    assert get_backend("torchsched", "dwb") != get_backend("torchsched", "wbd")
    with pytest.raises(ValueError, match="backend"):
        get_backend("tvm")
    with pytest.raises(ValueError, match="scheme"):
        get_backend("torchsched", "bdw")


@pytest.mark.parametrize("order", ["dwb", "wbd"])
def test_convolution_backward_split(order):
    x, w = rand(2, 4, 7, 6, dtype=torch.float64), rand(6, 2, 3, 3, dtype=torch.float64)
    args = [[6], [2, 1], [1, 1], [1, 1], False, [0, 0], 2]
    y = torch.ops.aten.convolution(x, w, rand(6, dtype=torch.float64), *args[1:])
    dy = rand(*y.shape, dtype=torch.float64)
    mask = [True, True, True]
    want = torch.ops.aten.convolution_backward(dy, x, w, *args, mask)
    got = _conv_backward_split(order, devices=("cpu",))(dy, x, w, *args, mask)
    for g, r in zip(got, want):
        assert_rel_close(g, r, torch.float64)
    # On CPU (and without a bias gradient) the registered decomposition declines: the fused operator stays.
    assert convolution_backward_decomp_dwb(dy, x, w, *args, mask) is NotImplemented
    assert _conv_backward_split(order, ("cpu",))(dy, x, w, *args, [True, True, False]) is NotImplemented


def test_compile_matches_eager_forward_and_backward(one_compile_thread):
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.LayerNorm(24),
                                torch.nn.Linear(24, 5))
    x = rand(7, 12).requires_grad_()
    with config.patch(enable_pre_grad_pass=True):
        compiled = torch.compile(model, backend="torchsched")
        torch._dynamo.utils.counters.clear()
        y = compiled(x)
    assert torch._dynamo.utils.counters["torchsched"]["pre_grad_cudnn_layer_norm"] == 1
    dy = rand(7, 5)
    gx, *gp = torch.autograd.grad(y, [x, *model.parameters()], dy)

    x64 = x.detach().double().requires_grad_()
    ref_model = copy.deepcopy(model).double()
    ref = ref_model(x64)
    rx, *rp = torch.autograd.grad(ref, [x64, *ref_model.parameters()], dy.double())
    assert_rel_close(y, ref, torch.float32, tol=1e-5)
    assert_rel_close(gx, rx, torch.float32, tol=1e-5, name="grad x")
    assert_rel_close(gp, rp, torch.float32, tol=1e-5, name="grad params")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cudnn_layer_norm_op(dtype):
    x = (rand(3, 4, 10) * 2 + 1).to(dtype).requires_grad_()
    w = rand(10).to(dtype).requires_grad_()
    b = rand(10).to(dtype).requires_grad_()
    y, mean, invstd = torch.ops.cudnn.layer_norm(x, [10], w, b, 1e-5)
    assert mean.shape == (12, 1, 1, 1) and invstd.dtype == torch.float32 and y.dtype == dtype
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, b))
    ref = F.layer_norm(x64, [10], w64, b64, 1e-5)
    assert_rel_close(y, ref, dtype, baseline=F.layer_norm(x, [10], w, b, 1e-5))
    assert_rel_close(mean.reshape(-1), x64.detach().mean(-1).reshape(-1), torch.float32)
    dy = rand(3, 4, 10).to(dtype)
    got = torch.autograd.grad(y, [x, w, b], dy)
    want = torch.autograd.grad(ref, [x64, w64, b64], dy.double())
    base = torch.autograd.grad(F.layer_norm(x, [10], w, b, 1e-5), [x, w, b], dy)
    for g, r, bs, name in zip(got, want, base, "xwb"):
        assert_rel_close(g, r, dtype, baseline=bs, name=f"grad {name}")
    with pytest.raises(ValueError, match="normalized_shape"):
        torch.ops.cudnn.layer_norm(x, [9], w, b, 1e-5)


def test_cudnn_layer_norm_opcheck():
    x, w, b = rand(2, 3, 6), rand(6), rand(6)
    torch.library.opcheck(torch.ops.cudnn.layer_norm.default, (x, [6], w, b, 1e-5),
                          test_utils=("test_schema", "test_faketensor"))


def test_pre_grad_pass_replaces_layer_norm_calls():
    def fn(x, w, b):
        h = F.layer_norm(x, (8,), w, b, 1e-6)
        return F.layer_norm(h * 2, (8,)) + F.layer_norm(h, (8,), weight=w, bias=b)

    gm = torch.fx.symbolic_trace(fn)
    args = (rand(4, 8), rand(8), rand(8))
    before = gm(*args)
    n = replace_layer_norm(gm.graph)
    gm.recompile()
    # The call without weight and bias is left alone.
    assert n == 2
    targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
    assert targets.count(torch.ops.cudnn.layer_norm.default) == 2
    assert targets.count(F.layer_norm) == 1
    assert_rel_close(gm(*args), before, torch.float32)


def test_set_default_backend(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", torch.compile)
    monkeypatch.setattr(ts, "__torch_compile__", lambda *a, backend=None, **k: seen.append(backend))
    monkeypatch.setattr(ts, "_DEFAULT_BACKEND", "inductor")
    with pytest.raises(ValueError, match="Unknown backend"):
        ts.set_default_backend("no-such-backend")
    assert torch.compile is not ts.torchsched_compile  # nothing changed by the bad call
    ts.set_default_backend("torchsched")
    torch.compile(torch.nn.Linear(2, 2))
    torch.compile(torch.nn.Linear(2, 2), backend="eager")
    assert seen == ["torchsched", "eager"]
