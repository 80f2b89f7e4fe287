"""apex.ops.fused_dense: dense chains (bias + activation fused) against a float64 reference, both backends."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import apex
from apex.ops import fused_dense as FD
from apex.testing import TritonTrace, assert_rel_close

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ACT_NAMES = ["none", "relu", "sigmoid"]
PAIRS = [(1, 7), (7, 129), (129, 1), (1000, 7), (7, 1000)]


def _act(z, name):
    if name == "relu":
        return torch.relu(z)
    if name == "sigmoid":
        return torch.sigmoid(z)
    if name == "gelu":
        return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    return z


def _plain(x, ws, bs, acts):
    """The same chain in plain PyTorch (F.linear + activation), in the tensors' own dtype."""
    for i, (w, a) in enumerate(zip(ws, acts)):
        x = F.linear(x, w, bs[i] if bs else None)
        x = F.gelu(x, approximate="tanh") if a == "gelu" else _act(x, a)
    return x


def _make(batch, sizes, dtype, bias=True):
    x = torch.randn(batch, sizes[0]).to(dtype).requires_grad_()
    ws = [(torch.randn(o, i) / math.sqrt(i)).to(dtype).requires_grad_() for i, o in zip(sizes, sizes[1:])]
    bs = [(0.5 * torch.randn(o)).to(dtype).requires_grad_() for o in sizes[1:]] if bias else []
    return x, ws, bs


def _grads(fn, leaves, dy):
    y = fn()
    return y, torch.autograd.grad(y, leaves, dy)


def _trace(backend_name, *tensors):
    if backend_name != "triton":
        return contextlib.nullcontext(None)
    return TritonTrace(bounds=True).watch(*tensors)


def check_chain(backend_name, batch, sizes, acts, dtype, bias=True):
    x, ws, bs = _make(batch, sizes, dtype, bias)
    leaves = [x, *ws, *bs]
    dy = torch.randn(batch, sizes[-1]).to(dtype)
    with _trace(backend_name, *leaves, dy) as tr:
        y, g = _grads(lambda: FD.dense_chain(x, ws, bs, acts), leaves, dy)
    if tr is not None:  # one launch per layer forward, two per layer backward
        assert tr.launches == 3 * len(ws), dict(tr.kernels)
    x64 = [t.detach().double().requires_grad_() for t in leaves]
    n = len(ws)
    ref_y, ref_g = _grads(lambda: _plain(x64[0], x64[1:1 + n], x64[1 + n:], acts), x64, dy.double())
    base_y, base_g = _grads(lambda: _plain(x, ws, bs, acts), leaves, dy)
    assert y.dtype == dtype and all(t.dtype == dtype for t in g)
    tol = 1e-5 if dtype == torch.float32 else None
    assert_rel_close(y, ref_y, dtype, tol=tol, baseline=base_y, name="y")
    assert_rel_close(list(g), list(ref_g), dtype, tol=tol, baseline=list(base_g), name="grads")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ACT_NAMES)
@pytest.mark.parametrize("pair", PAIRS, ids=str)
def test_single_layer_matches_float64(backend_name, pair, act, dtype):
    check_chain(backend_name, 9, list(pair), (act,), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sizes,acts", [([7, 129, 33, 5], ("relu", "sigmoid", "relu")),
                                        ([129, 257, 7], ("gelu", "none")),
                                        ([1, 7, 129], ("sigmoid", "none")),
                                        ([33, 7, 1], ("gelu", "relu"))], ids=str)
def test_chains_match_float64(backend_name, sizes, acts, dtype):
    check_chain(backend_name, 13, sizes, acts, dtype)


@pytest.mark.parametrize("act", ACT_NAMES)
def test_no_bias(backend_name, act):
    check_chain(backend_name, 11, [7, 129, 5], (act, act), torch.float32, bias=False)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.integers(1, 40), sizes=st.lists(st.integers(1, 70), min_size=2, max_size=4),
       act=st.sampled_from(["none", "relu", "sigmoid"]))
def test_random_shapes(backend_name, batch, sizes, act):
    check_chain(backend_name, batch, sizes, (act,) * (len(sizes) - 1), torch.float32)


def test_leading_dims_and_non_contiguous(backend_name):
    x = torch.randn(3, 9, 4).transpose(1, 2).requires_grad_()  # [3, 4, 9], non-contiguous
    w = torch.randn(6, 9, requires_grad=True)
    w_t = torch.randn(9, 6).t().requires_grad_()  # non-contiguous weight
    b = torch.randn(6, requires_grad=True)
    dy = torch.randn(3, 4, 6)
    for weight in (w, w_t):
        y, g = _grads(lambda w=weight: FD.dense_chain(x, [w], [b], ("relu",)), [x, weight, b], dy)
        ref_y, ref_g = _grads(lambda w=weight: torch.relu(F.linear(x.double(), w.double(), b.double())),
                              [x, weight, b], dy.double())
        assert y.shape == (3, 4, 6)
        assert_rel_close(y, ref_y, tol=1e-5)
        assert_rel_close(list(g), list(ref_g), tol=1e-5)


def test_strided_bias(backend_name):
    """A bias that is a strided view (a column of a matrix): read at its own strides, not as contiguous
    memory, through the module entry (cached plans after the first call) and the functional chain."""
    from apex.fused_dense import FusedDense

    x, dy = torch.randn(5, 9, requires_grad=True), torch.randn(5, 6)
    table = torch.randn(6, 3)
    mod = FusedDense(9, 6)
    with torch.no_grad():
        mod.bias.set_(table[:, 1])  # stride 3
    assert not mod.bias.is_contiguous()
    for call in (lambda: mod(x), lambda: mod(x), lambda: FD.dense_chain(x, [mod.weight], [mod.bias], ("none",))):
        y, g = _grads(call, [x, mod.weight, mod.bias], dy)
        ref_y, ref_g = _grads(lambda: F.linear(x.double(), mod.weight.double(), mod.bias.double()),
                              [x, mod.weight, mod.bias], dy.double())
        assert_rel_close(y, ref_y, tol=1e-5)
        assert_rel_close(list(g), list(ref_g), tol=1e-5)


@pytest.mark.parametrize("sizes", [[0, 5], [4, 0, 5]], ids=str)
@pytest.mark.parametrize("act", ACT_NAMES)
def test_bias_gradient_of_a_layer_without_input_columns(backend_name, act, sizes):
    """A layer whose input has no columns (in_features 0, or an empty hidden layer) has an empty weight
    gradient, so no GEMM runs whose epilogue sums the bias gradient: it must still be the rows' sum (the
    Triton path returned uninitialised memory). Twice: the general path, then the cached plan."""
    x, ws, bs = _make(3, sizes, torch.float32)
    with torch.no_grad():
        for b in bs:
            b.normal_()  # (an activation's derivative not constant over the outputs)
    leaves = [x, *ws, *bs]
    dy = torch.randn(3, sizes[-1])
    acts = ("relu",) * (len(ws) - 1) + (act,)
    x64 = [t.detach().double().requires_grad_() for t in leaves]
    n = len(ws)
    ref_y, ref_g = _grads(lambda: _plain(x64[0], x64[1:1 + n], x64[1 + n:], acts), x64, dy.double())
    for _ in range(2):
        y, g = _grads(lambda: FD.dense_chain(x, ws, bs, acts), leaves, dy)
        assert_rel_close(y, ref_y, tol=1e-6)
        for got, want in zip(g, ref_g):
            assert got.shape == want.shape
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_only_weight_grads(backend_name):
    x, ws, bs = _make(5, [7, 9, 3], torch.float32)
    x.requires_grad_(False)
    y = FD.dense_chain(x, ws, bs, ("relu", "relu"))
    g = torch.autograd.grad(y.sum(), ws + bs)
    x64 = x.double()
    w64 = [w.detach().double().requires_grad_() for w in ws + bs]
    ref = _plain(x64, w64[:2], w64[2:], ("relu", "relu"))
    assert_rel_close(list(g), list(torch.autograd.grad(ref.sum(), w64)), tol=1e-5)


def test_autocast_computes_in_autocast_dtype(backend_name, device):
    x, ws, bs = _make(6, [7, 129, 3], torch.float32)
    # Autocast of the device the case runs on: the GPU's under APEX_TEST_DEVICE=cuda.
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = FD.dense_chain(x, ws, bs, ("relu", "none"))
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and ws[0].grad.dtype == torch.float32
    with torch.autocast(device.type, dtype=torch.bfloat16):
        base = _plain(x, ws, bs, ("relu", "none"))
    ref = _plain(x.double(), [w.double() for w in ws], [b.double() for b in bs], ("relu", "none"))
    assert_rel_close(y, ref, torch.bfloat16, baseline=base)


class _ReportsCuda(torch.Tensor):
    """A tensor whose ``device`` says CUDA, whatever memory holds it: on a CPU-only machine it tells an
    autocast query made with the inputs' device type from one made with a fixed ``"cpu"``."""

    @property
    def device(self):
        return torch.device("cuda")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():  # every result is a plain tensor again
            return func(*args, **(kwargs or {}))


@pytest.fixture
def cuda_autocast_only():
    """CUDA autocast on (bf16) and CPU autocast off, restored afterwards. Setting CUDA's autocast state
    needs no GPU; it only changes what ``torch.is_autocast_enabled("cuda")`` answers."""
    saved = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cuda", "cpu")}
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    torch.set_autocast_enabled("cpu", False)
    try:
        yield
    finally:
        for d, (on, dt) in saved.items():
            torch.set_autocast_enabled(d, on)
            torch.set_autocast_dtype(d, dt)


@pytest.mark.parametrize("entry", ["dense_chain", "FusedDense", "FusedDenseGeluDense", "MLP"])
def test_autocast_follows_the_inputs_device_type(backend_name, cuda_autocast_only, entry):
    # The input reports device type "cuda" while autocast is on for CUDA only: the entry must cast to
    # CUDA's autocast dtype. Code that asks about a fixed device type ("cpu") returns fp32 here, as the
    # Triton path did on a GPU before it asked with the tensors' device type.
    from apex.fused_dense import FusedDense, FusedDenseGeluDense
    from apex.mlp import MLP

    x = torch.randn(6, 7).as_subclass(_ReportsCuda)
    assert x.device.type == "cuda"
    if entry == "dense_chain":
        _, ws, bs = _make(6, [7, 9, 3], torch.float32)
        y = FD.dense_chain(x, ws, bs, ("relu", "none"))
    else:
        module = {"FusedDense": lambda: FusedDense(7, 3), "FusedDenseGeluDense": lambda: FusedDenseGeluDense(7, 9, 3),
                  "MLP": lambda: MLP([7, 9, 3])}[entry]()
        y = module(x)
    assert y.dtype == torch.bfloat16, f"{entry} ignored autocast of its input's device type: {y.dtype}"


def test_tf32_follows_pytorch_flag(monkeypatch, triton_device):
    from apex._kernels import fused_dense as K

    seen = []
    real = K.linear  # a layer's forward GEMM: (a, w, bias, epi_act, pro_a, allow_tf32)
    monkeypatch.setattr(K, "linear", lambda *a: seen.append(a[5]) or real(*a))
    x, ws, bs = _make(4, [7, 5], torch.float32)
    # torch's cuBLAS flag object refuses ``delattr``, which is how pytest >= 9.2's monkeypatch undoes an
    # attribute it did not find in the instance's ``__dict__``; set and restore it by hand.
    flag = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        with apex.backend("triton"):
            FD.dense_chain(x, ws, bs, ("none",))
            torch.backends.cuda.matmul.allow_tf32 = True
            FD.dense_chain(x, ws, bs, ("none",))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag
    assert seen == [False, True]


@pytest.mark.parametrize("bad,err,match", [
    (lambda x, w, b: (x.long(), [w], [b]), TypeError, "input must be a floating"),
    (lambda x, w, b: (x[:, :3], [w], [b]), ValueError, "weight 0 expects 5 input features"),
    (lambda x, w, b: (x, [w.half()], [b]), TypeError, "weight 0 has dtype"),
    (lambda x, w, b: (x, [w], [b[:2]]), ValueError, "bias 0 must have shape"),
    (lambda x, w, b: (x, [w[0]], [b]), ValueError, "weight 0 must be a 2-D"),
    (lambda x, w, b: (x, [w], [b.double()]), TypeError, "bias 0 has dtype"),
])
def test_bad_input_is_rejected(bad, err, match):
    x, w, b = torch.randn(4, 5), torch.randn(3, 5), torch.randn(3)
    args = bad(x, w, b)
    with pytest.raises(err, match=match):
        FD.dense_chain(*args, ("relu",))
    with pytest.raises(ValueError, match="activation codes"):
        FD.dense_chain(x, [w], [b], (7,))


def test_one_layer_calls_are_checked_in_full():
    """A one-layer call passes a quick check, which must let every wrong call through to the full checks and
    their errors: activations of another count, two biases, a weight on another device, a 0-d input, a
    tensor subclass that is wrong."""
    x, w, b = torch.randn(4, 5), torch.randn(3, 5), torch.randn(3)
    with pytest.raises(ValueError, match="one activation per layer"):
        FD.dense_chain(x, [w], [b], ("relu", "none"))
    with pytest.raises(ValueError, match="one per weight"):
        FD.dense_chain(x, [w], [b, b], ("relu",))
    with pytest.raises(ValueError, match="is on meta"):
        FD.dense_chain(x, [w.to("meta")], [b], ("relu",))
    with pytest.raises(ValueError, match="at least one dimension"):
        FD.dense_chain(torch.tensor(1.0), [w], [b], ("relu",))
    with pytest.raises(ValueError, match="bias 0 must have shape"):
        FD.dense_chain(x, [w], [torch.nn.Parameter(torch.randn(3, 1))], ("relu",))


@pytest.mark.parametrize("bad,err,match", [
    (lambda x, ws, bs: (x, ws, bs, ("relu",)), ValueError, "one activation per layer"),
    (lambda x, ws, bs: (x, ws, bs[:1], ("relu", "none")), ValueError, "one per weight"),
    (lambda x, ws, bs: (x, [ws[0], ws[1].to("meta")], bs, ("relu", "none")), ValueError, "weight 1 is on meta"),
    (lambda x, ws, bs: (x, [ws[0], ws[1][:, :4]], bs, ("relu", "none")), ValueError, "weight 1 expects 4"),
    (lambda x, ws, bs: (x, [ws[0], ws[1].double()], bs, ("relu", "none")), TypeError, "weight 1 has dtype"),
    (lambda x, ws, bs: (x, ws, [bs[0], bs[1][:2]], ("relu", "none")), ValueError, "bias 1 must have shape"),
    (lambda x, ws, bs: (x, ws, [bs[0], bs[1].half()], ("relu", "none")), TypeError, "bias 1 has dtype"),
    (lambda x, ws, bs: (x, [ws[0], ws[1][0]], bs, ("relu", "none")), ValueError, "weight 1 must be a 2-D"),
])
def test_chain_calls_are_checked_in_full(bad, err, match):
    """A chain of several layers passes a quick check, which must let every wrong call through to the full
    checks and their errors (a wrong second layer included)."""
    x, ws, bs = torch.randn(4, 5), [torch.randn(6, 5), torch.randn(3, 6)], [torch.randn(6), torch.randn(3)]
    with pytest.raises(err, match=match):
        FD.dense_chain(*bad(x, ws, bs))


def test_compat_fused_dense_cuda(backend_name):
    import fused_dense_cuda

    x, (w1, w2), (b1, b2) = _make(6, [7, 129, 5], torch.float32)
    out = fused_dense_cuda.linear_bias_forward(x, w1, b1)
    assert_rel_close(out, F.linear(x.double(), w1.double(), b1.double()), tol=1e-5)
    dy = torch.randn(6, 129)
    dx, dw, db = fused_dense_cuda.linear_bias_backward(x, w1, dy)
    assert_rel_close([dx, dw, db], [dy.double() @ w1.double(), dy.double().t() @ x.double(), dy.double().sum(0)],
                     tol=1e-5)
    o1, o2, h = fused_dense_cuda.linear_gelu_linear_forward(x, w1, b1, w2, b2)
    ref_h = F.linear(x.double(), w1.double(), b1.double())
    assert_rel_close([h, o1, o2], [ref_h, _act(ref_h, "gelu"),
                                   F.linear(_act(ref_h, "gelu"), w2.double(), b2.double())], tol=1e-5)
    dy2 = torch.randn(6, 5)
    grads = fused_dense_cuda.linear_gelu_linear_backward(x, h, o1, w1, w2, dy2)
    p64 = [t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    ref = _plain(p64[0], [p64[1], p64[3]], [p64[2], p64[4]], ("gelu", "none"))
    assert_rel_close(list(grads), list(torch.autograd.grad(ref, p64, dy2.double())), tol=1e-5)


@pytest.mark.parametrize("which", ["d_output", "gelu_in", "output1", "d_output2"])
def test_compat_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """fused_dense_cuda's backward entries refuse a gradient or saved tensor on another device than the input,
    naming it, before a kernel reads it; ``meta`` stands in for another device."""
    import fused_dense_cuda

    x = torch.randn(6, 7, device=device)
    w1, b1, w2, b2 = (torch.randn(9, 7, device=device), torch.randn(9, device=device),
                      torch.randn(5, 9, device=device), torch.randn(5, device=device))
    before = [t.clone() for t in (x, w1, w2)]
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        if which == "d_output":
            fused_dense_cuda.linear_bias_backward(x, w1, torch.randn(6, 9, device="meta"))
        else:
            o1, _, h = fused_dense_cuda.linear_gelu_linear_forward(x, w1, b1, w2, b2)
            args = {"gelu_in": h, "output1": o1, "d_output2": torch.randn(6, 5, device=device)}
            args[which] = args[which].to("meta")
            fused_dense_cuda.linear_gelu_linear_backward(x, args["gelu_in"], args["output1"], w1, w2,
                                                         args["d_output2"])
    assert all(torch.equal(a, b) for a, b in zip((x, w1, w2), before))


@pytest.mark.parametrize("which", ["grad_o", "fprop_outputs"])
def test_compat_mlp_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """mlp_cuda.backward refuses a gradient or reserved space on another device than the input, naming it;
    ``meta`` stands in for another device."""
    import mlp_cuda

    x = torch.randn(6, 7, device=device)
    ws = [torch.randn(9, 7, device=device), torch.randn(5, 9, device=device)]
    bs = [torch.randn(9, device=device), torch.randn(5, device=device)]
    out, reserved = mlp_cuda.forward(1, 1, [x, *ws, *bs])
    dy = torch.randn(6, 5, device=device)
    if which == "grad_o":
        dy = dy.to("meta")
    else:
        reserved = reserved.to("meta")
    with pytest.raises(ValueError, match=f"{which}.* is on meta"):
        mlp_cuda.backward(1, 1, dy, [out, reserved], [x, *ws, *bs])


def test_compat_mlp_cuda(backend_name):
    import mlp_cuda

    x, ws, bs = _make(6, [7, 33, 5], torch.float32)
    out, reserved = mlp_cuda.forward(1, 2, [x, *ws, *bs])
    assert reserved.dim() == 1 and reserved.numel() == 6 * (33 + 5)
    p64 = [t.detach().double().requires_grad_() for t in (x, *ws, *bs)]
    ref = _plain(p64[0], p64[1:3], p64[3:], ("sigmoid", "sigmoid"))
    assert_rel_close(out, ref, tol=1e-5)
    dy = torch.randn(6, 5)
    grads = mlp_cuda.backward(1, 2, dy, [out, reserved], [x, *ws, *bs])
    assert_rel_close(list(grads), list(torch.autograd.grad(ref, p64, dy.double())), tol=1e-5)
    with pytest.raises(ValueError, match="fprop_outputs"):
        mlp_cuda.backward(1, 2, dy, [out, reserved[:-1]], [x, *ws, *bs])
    with pytest.raises(ValueError, match="activation"):
        mlp_cuda.forward(1, 5, [x, *ws, *bs])


def test_gemm_transposed_operands_by_strides(triton_device):
    """trans_a / trans_b read a [K, M] operand (and its aux) or a [N, K] weight through swapped strides: the
    same result as the caller's transposed views, which the chain no longer builds (an operator each)."""
    from apex._kernels import fused_dense as K

    a, w, aux = torch.randn(24, 9), torch.randn(13, 24), torch.randn(24, 9)
    b = torch.randn(24, 7)
    assert torch.equal(K.gemm(a.t(), w.t(), trans_a=False), K.gemm(a, w, trans_a=True, trans_b=True))
    assert torch.equal(K.gemm(a, b, dact_a=1, aux_a=aux, trans_a=True),
                       K.gemm(a.t(), b, dact_a=1, aux_a=aux.t()))


def test_gemm_launch_options_only_where_not_default(monkeypatch):
    """A GPU plan passes ``num_warps``/``num_stages`` only where they differ from Triton's defaults (4 warps,
    the backend's stages; a keyword costs every launch): a 128x128 tile still gets its 8 warps."""
    from apex._kernels import fused_dense as K

    monkeypatch.setattr(K, "_INTERP", False)
    cfgs = {64: dict(BM=64, BN=64, BK=32, GROUP_M=8, num_warps=4, num_stages=None),
            128: dict(BM=128, BN=128, BK=32, GROUP_M=8, num_warps=8, num_stages=None),
            2: dict(BM=64, BN=64, BK=16, GROUP_M=8, num_warps=4, num_stages=2)}
    monkeypatch.setattr(K, "_config", lambda m, n, k, dt: cfgs[m])
    monkeypatch.setattr(K, "_PLANS", {})
    assert K._plan(64, 64, 64, torch.float32)[3] == {}
    assert K._plan(128, 64, 64, torch.float32)[3] == {"num_warps": 8}
    assert K._plan(2, 64, 64, torch.float32)[3] == {"num_stages": 2}


_COMPILED_GPU_STEPS = '''
import torch
import torch.utils._triton

# Dynamo records a Triton kernel call (not an inlined Python call) only where it finds a GPU Triton can use.
torch.utils._triton.has_triton = lambda: True

import apex
import apex.ops.fused_dense as ops
from apex.fused_dense import FusedDense, FusedDenseGeluDense
from apex.mlp import MLP
from apex.testing.triton_compile import compile_only

ops._use_triton = lambda x, *_, compiling=None: True  # as for CUDA tensors under torch.compile
for name, make in [("MLP", lambda: MLP([8, 6, 4])), ("FusedDense", lambda: FusedDense(8, 4)),
                   ("FusedDenseGeluDense", lambda: FusedDenseGeluDense(8, 6, 4))]:
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(make(), backend=lambda gm, example_inputs: (graphs.append(gm), gm)[1])
    x = torch.randn(3, 8, requires_grad=True)
    with compile_only("cuda:90"), apex.backend("triton"):
        for _ in range(3):
            compiled(x).square().sum().backward()
    ops_in = {str(n.target) for gm in graphs for m in gm.modules() for n in m.graph.nodes}
    print(name, len(graphs), "triton_kernel_wrapper_mutation" in ops_in)
'''


@pytest.mark.slow
def test_compiled_chains_trace_their_triton_kernels_in_one_graph():
    """Compiled training steps of MLP, FusedDense and FusedDenseGeluDense on the Triton path (CUDA tensors'
    under torch.compile) trace one graph that calls the GEMM kernel as a Triton kernel: Dynamo's own handling
    of ``kernel[grid](...)``, seen without a GPU through ``compile_only`` (launches compile for sm_90) in a
    process without the interpreter. On a GPU the launch plans that the tracing read from, and put in, the
    kernels' module-level cache made 8 and 5 graphs for MLP and FusedDense."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "APEX_BACKEND", "TORCH_LOGS")}
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", _COMPILED_GPU_STEPS], capture_output=True, text=True, env=env,
                          cwd=root, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.split("\n")[:3] == ["MLP 1 True", "FusedDense 1 True", "FusedDenseGeluDense 1 True"], \
        proc.stdout
