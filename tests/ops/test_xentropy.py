"""apex.ops.xentropy: losses and logits' gradients against a float64 reference on both backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex.ops import xentropy as X
from apex.testing import assert_rel_close
from tests.ops._modes import Recorder as _Recorder
from tests.ops._norms import DTYPES, trace


def _inputs(m, v, dtype, pad_frac=0.25, padding_idx=0, scale=3.0):
    x = (torch.randn(m, v) * scale).to(dtype)
    lab = torch.randint(0, v, (m,))
    pad = torch.rand(m) < pad_frac
    if padding_idx is not None:
        lab[pad] = padding_idx
    return x, lab


def _ref(x, lab, smoothing, padding_idx, dy):
    x64 = x.detach().double().requires_grad_()
    logp = torch.log_softmax(x64, -1)
    pad = lab == padding_idx if padding_idx is not None else torch.zeros_like(lab, dtype=torch.bool)
    safe = lab.masked_fill(pad, 0)
    loss = -(1 - smoothing) * logp.gather(-1, safe[:, None]).squeeze(-1) - smoothing * logp.mean(-1)
    loss = loss.masked_fill(pad, 0)
    (dx,) = torch.autograd.grad(loss, x64, dy.double())
    return loss.detach(), dx


def _baseline(x, lab, smoothing, padding_idx, dy):
    """PyTorch's own cross entropy in the logits' dtype (for the fp16/bf16 error bound)."""
    xb = x.detach().clone().requires_grad_()
    ign = padding_idx if padding_idx is not None else -100
    loss = F.cross_entropy(xb, lab, reduction="none", ignore_index=ign, label_smoothing=smoothing)
    (dx,) = torch.autograd.grad(loss, xb, dy.to(loss.dtype))
    return loss, dx


def _run(x, lab, smoothing, padding_idx, dy, inplace=False):
    leaf = x.detach().clone().requires_grad_()
    logits = leaf * 1 if inplace else leaf  # a non-leaf for the in-place backward
    losses = X.softmax_cross_entropy(logits, lab, smoothing, padding_idx, inplace_backward=inplace)
    (dx,) = torch.autograd.grad(losses, leaf, dy)
    return losses, dx


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,v", [(1, 1), (13, 77), (6, 2053), (3, 9001)], ids=str)
def test_xentropy_matches_float64(backend_name, m, v, dtype, smoothing):
    x, lab = _inputs(m, v, dtype)
    dy = torch.randn(m)
    with trace(backend_name, x, lab, dy) as tr:
        losses, dx = _run(x, lab, smoothing, 0, dy)
    if tr is not None:
        assert tr.launches == 2  # one forward pass, one backward pass
    ref_l, ref_dx = _ref(x, lab, smoothing, 0, dy)
    assert losses.dtype == (torch.float32) and dx.dtype == dtype
    assert_rel_close(losses, ref_l, tol=1e-5, name="losses")
    if dtype == torch.float32:
        assert_rel_close(dx, ref_dx, tol=1e-5, name="dx")
    else:
        _, base_dx = _baseline(x, lab, smoothing, 0, dy)
        # The interpreter truncates fp32 → bf16: allow one more ulp there.
        tol = 2 * 2 ** -8 if dtype == torch.bfloat16 else None
        assert_rel_close(dx, ref_dx, dtype, tol=tol, baseline=base_dx, name="dx")


def test_xentropy_padding_rows_give_zero_loss_and_grad(backend_name):
    x, lab = _inputs(10, 300, torch.float32, pad_frac=0.0)
    lab[[1, 4, 7]] = 5  # padding_idx = 5
    dy = torch.randn(10)
    with trace(backend_name, x, lab, dy):
        losses, dx = _run(x, lab, 0.2, 5, dy)
    assert (losses[[1, 4, 7]] == 0).all() and (dx[[1, 4, 7]] == 0).all()
    assert (losses[[0, 2, 3]] != 0).all()
    ref_l, ref_dx = _ref(x, lab, 0.2, 5, dy)
    assert_rel_close([losses, dx], [ref_l, ref_dx], tol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_xentropy_inplace_backward_writes_into_the_logits(backend_name, dtype):
    x, lab = _inputs(9, 1500, dtype)
    dy = torch.randn(9)
    logits = x.clone().requires_grad_()
    inner = logits * 1
    buf = inner.data_ptr()
    with trace(backend_name, inner, lab, dy):
        losses = X.softmax_cross_entropy(inner, lab, 0.1, 0, inplace_backward=True)
        (dx,) = torch.autograd.grad(losses, inner, dy)
    assert dx.data_ptr() == buf  # the gradient lives in the logits' buffer: no second [rows, V] tensor
    _, ref_dx = _ref(x, lab, 0.1, 0, dy)
    _, copy_dx = _run(x, lab, 0.1, 0, dy)
    assert_rel_close(dx, copy_dx, dtype, tol=1e-6 if dtype == torch.float32 else 2 ** -7)
    assert_rel_close(dx, ref_dx, dtype, tol=1e-5 if dtype == torch.float32 else 2 * 2 ** -8)


def test_xentropy_non_contiguous_and_batched(backend_name):
    x = torch.randn(2, 5, 300)[:, :, :257]
    lab = torch.randint(0, 257, (2, 5))
    lab[0, 1] = 0
    dy = torch.randn(2, 5)
    assert not x.is_contiguous()
    with trace(backend_name, x, lab, dy):
        leaf = x.clone().requires_grad_()
        losses = X.softmax_cross_entropy(leaf, lab, 0.1, 0)
        (dx,) = torch.autograd.grad(losses, leaf, dy)
    ref_l, ref_dx = _ref(x.reshape(10, 257), lab.reshape(10), 0.1, 0, dy.reshape(10))
    assert_rel_close(losses.reshape(10), ref_l, tol=1e-5)
    assert_rel_close(dx.reshape(10, 257), ref_dx, tol=1e-5)


def test_xentropy_apex_entry_points(backend_name):
    import xentropy_cuda

    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    x, lab = _inputs(8, 500, torch.float16)
    dy = torch.randn(8)
    losses, mlse = xentropy_cuda.forward(x, lab, 0.1, True)
    assert losses.dtype == torch.float32 and mlse.dtype == torch.float32
    assert_rel_close(mlse, torch.logsumexp(x.double(), -1), tol=1e-6)
    ref_l, ref_dx = _ref(x, lab, 0.1, None, dy)  # no padding masking in the raw entry points
    assert_rel_close(losses, ref_l, tol=1e-5)
    dx = xentropy_cuda.backward(dy, x, mlse, lab, 0.1)
    assert dx.dtype == torch.float16
    assert_rel_close(dx, ref_dx, torch.float16)
    _, mlse_h = xentropy_cuda.forward(x, lab, 0.1, False)
    assert mlse_h.dtype == torch.float16
    leaf = x.clone().requires_grad_()
    out = SoftmaxCrossEntropyLoss.apply(leaf, lab, 0.1, 0, True)
    (g,) = torch.autograd.grad(out, leaf, dy)
    ref_l, ref_dx = _ref(x, lab, 0.1, 0, dy)
    assert_rel_close([out, g], [ref_l, ref_dx], torch.float16, tol=2e-3)


def test_xentropy_bad_input_raises_and_writes_nothing(backend_name):
    x = torch.randn(4, 10)
    before = x.clone()
    lab = torch.tensor([1, 2, 10, 0])
    if backend_name == "torch":  # the Triton path gives a NaN loss instead (the next test)
        with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\).*got 10"):
            X.softmax_cross_entropy(x, lab)
        with pytest.raises(ValueError, match="labels must lie"):
            X.softmax_cross_entropy(x, torch.tensor([1, -1, 2, 3]))
    with pytest.raises(ValueError, match=r"labels must have shape \[4\]"):
        X.softmax_cross_entropy(x, torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="labels must be an integer"):
        X.softmax_cross_entropy(x, torch.ones(4))
    with pytest.raises(TypeError, match="logits must be a floating-point"):
        X.softmax_cross_entropy(torch.ones(4, 10, dtype=torch.int64), torch.tensor([1, 2, 3, 0]))
    with pytest.raises(ValueError, match="smoothing"):
        X.softmax_cross_entropy(x, torch.tensor([1, 2, 3, 0]), smoothing=1.5)
    with pytest.raises(ValueError, match="V > 0"):
        X.softmax_cross_entropy(torch.randn(4, 0), torch.tensor([1, 2, 3, 0]))
    leaf = x.clone().requires_grad_()
    with pytest.raises(ValueError, match="leaf tensor"):
        X.softmax_cross_entropy(leaf, torch.tensor([1, 2, 3, 0]), inplace_backward=True)
    with pytest.raises(ValueError, match="grad_loss must have shape"):
        X.softmax_cross_entropy_backward(torch.ones(3), x, torch.ones(4), torch.tensor([1, 2, 3, 0]))
    assert torch.equal(x, before)


@pytest.mark.parametrize("which", ["grad_loss", "max_log_sum_exp"])
def test_xentropy_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """The backward refuses a gradient or saved log-sum-exp on another device than the logits (``meta``
    standing in), naming it, before a kernel reads it; the logits, which an in-place backward overwrites, keep
    their values."""
    x = torch.randn(4, 10, device=device)
    lab = torch.tensor([1, 2, 3, 0], device=device)
    _, lse = X.softmax_cross_entropy_forward(x, lab)
    args = {"grad_loss": torch.ones(4, device=device), "max_log_sum_exp": lse}
    args[which] = args[which].to("meta")
    before = x.clone()
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        X.softmax_cross_entropy_backward(args["grad_loss"], x, args["max_log_sum_exp"], lab, inplace=True)
    assert torch.equal(x, before)


class _NoHostRead:
    """Within the block a tensor read back by the host (``item``, ``bool``, ``int``, ``float``, ``tolist``,
    ``numpy``) fails: on a GPU each of these waits for the device. On CUDA, PyTorch's sync debug mode too."""

    NAMES = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "numpy")

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        def refuse(name):
            def read(*args, **kwargs):
                raise AssertionError(f"Tensor.{name}: a host read (a device synchronisation on a GPU)")
            return read

        self.saved = {name: getattr(torch.Tensor, name) for name in self.NAMES}
        for name in self.NAMES:
            setattr(torch.Tensor, name, refuse(name))
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)
        return False


@pytest.mark.parametrize("padding_idx", [0, None, -100])
def test_xentropy_out_of_range_labels_give_nan_without_a_host_read(triton_device, padding_idx):
    """The Triton path checks labels in its kernels: a label outside [0, V) that is not padding_idx gives that
    row a NaN loss and a zero gradient, the other rows their values, and nothing is read back by the host."""
    import apex

    x, lab = _inputs(6, 40, torch.float32, pad_frac=0.0, padding_idx=padding_idx)
    lab[0] = 40
    lab[3] = -1 if padding_idx != -1 else -2
    pad = 0 if padding_idx is None else padding_idx
    lab[5] = pad if padding_idx is not None else lab[5]
    x, lab = x.to(triton_device), lab.to(triton_device)
    leaf = x.clone().requires_grad_()
    dy = torch.rand(6, device=triton_device) + 0.5
    with apex.backend("triton"), _NoHostRead(triton_device):
        out = X.softmax_cross_entropy(leaf, lab, 0.1, padding_idx)
        (g,) = torch.autograd.grad(out, leaf, dy)
    out, g, x, lab, dy = (t.cpu() for t in (out, g, x, lab, dy))
    bad = torch.zeros(6, dtype=torch.bool)
    bad[[0, 3]] = True
    assert torch.isnan(out[bad]).all() and torch.isfinite(out[~bad]).all()
    assert not g[bad].any()
    good = ~bad
    ref_l, ref_dx = _ref(x[good], lab[good], 0.1, padding_idx, dy[good])
    assert_rel_close([out[good], g[good]], [ref_l, ref_dx], torch.float32)


def test_xentropy_padding_idx_outside_the_vocabulary(backend_name):
    x, lab = _inputs(6, 40, torch.float32, pad_frac=0.0)
    lab[2] = -100
    dy = torch.randn(6)
    losses, dx = _run(x, lab, 0.0, -100, dy)
    ref_l, ref_dx = _ref(x, lab, 0.0, -100, dy)
    assert losses[2] == 0
    assert_rel_close([losses, dx], [ref_l, ref_dx], tol=1e-5)


def test_xentropy_float64_uses_float64():
    x, lab = _inputs(5, 33, torch.float64)
    dy = torch.randn(5, dtype=torch.float64)
    losses, dx = _run(x, lab, 0.3, 0, dy)
    ref_l, ref_dx = _ref(x, lab, 0.3, 0, dy)
    assert losses.dtype == torch.float64
    assert_rel_close([losses, dx], [ref_l, ref_dx], tol=1e-12)


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 20), v=st.integers(1, 3000), smoothing=st.sampled_from([0.0, 0.05, 1.0]))
def test_xentropy_random_shapes(backend_name, m, v, smoothing):
    torch.manual_seed(m * 10000 + v)
    x, lab = _inputs(m, v, torch.float32)
    dy = torch.randn(m)
    with trace(backend_name, x, lab, dy):
        losses, dx = _run(x, lab, smoothing, 0, dy)
    ref_l, ref_dx = _ref(x, lab, smoothing, 0, dy)
    assert_rel_close([losses, dx], [ref_l, ref_dx], tol=1e-5)


def test_xentropy_apply_without_a_gradient_runs_the_forward_alone(backend_name, monkeypatch):
    """``SoftmaxCrossEntropyLoss.apply`` with nothing to differentiate (``no_grad``, logits without grad)
    computes the losses without the Function's context and saved tensors: the same losses, no grad_fn; with a
    gradient it goes through the Function (its forward and backward), a leaf's in-place backward still
    refused."""
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    x, lab = _inputs(8, 40, torch.float32)
    x.requires_grad_()
    ref = SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False)
    assert ref.grad_fn is not None
    ran: list = []
    forward = X._EagerLoss.forward  # the Function an eager call with a gradient takes
    monkeypatch.setattr(X._EagerLoss, "forward", staticmethod(lambda *a: ran.append(1) or forward(*a)))
    from apex.ops import _xentropy_direct as D  # the planned Triton path's Function: the same job
    lean_forward = D._DirectLoss.forward
    monkeypatch.setattr(D._DirectLoss, "forward", staticmethod(lambda *a: ran.append(1) or lean_forward(*a)))
    with torch.no_grad():
        got = SoftmaxCrossEntropyLoss.apply(x, lab, 0.1)
        with pytest.raises(ValueError, match="inplace_backward"):
            SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False, True)
    got2 = SoftmaxCrossEntropyLoss.apply(x.detach(), lab, 0.1, 0)
    assert ran == [] and got.grad_fn is None and got2.grad_fn is None
    torch.testing.assert_close(got, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close(got2, ref.detach(), rtol=0, atol=0)
    SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False).sum().backward()
    assert ran == [1] and x.grad is not None


# ------------------------------------------------------------------ torch.compile, dispatch modes, torch.func
def _compile_inputs(dev, shape=(8, 40)):
    x = (torch.randn(*shape, device=dev) * 3).requires_grad_()
    lab = torch.randint(0, shape[-1], shape[:-1], device=dev)
    lab.view(-1)[::3] = 0  # padding rows
    dy = torch.randn(shape[:-1], device=dev)
    return x, lab, dy


@pytest.mark.parametrize("shape", [(8, 40), (2, 4, 40)], ids=str)
def test_xentropy_compile_fullgraph_matches_eager(backend_name, device, shape):
    """torch.compile(fullgraph=True) of the loss and its backward: one graph holding the registered forward and
    backward ops (the launcher is never traced), eager's losses and gradients, and no recompile for a second
    step on new values of the same shapes."""
    from torch._dynamo.backends.registry import lookup_backend

    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    torch._dynamo.reset()
    graphs: list = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)  # the fake implementations meet AOTAutograd

    def step(x, lab, dy):
        return (SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False) * dy).sum()

    compiled = torch.compile(step, fullgraph=True, backend=record)
    for _ in range(2):
        x, lab, dy = _compile_inputs(device, shape)
        out = compiled(x, lab, dy)
        (dx,) = torch.autograd.grad(out, x)
        ref = step(x, lab, dy)
        (ref_dx,) = torch.autograd.grad(ref, x)
        assert_rel_close(out, ref, tol=1e-6, name="loss")
        assert_rel_close(dx, ref_dx, tol=1e-6, name="dx")
    assert len(graphs) == 1, f"{len(graphs)} graphs for two steps of the same shapes"
    targets = {str(n.target) for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule)
               for n in m.graph.nodes if n.op == "call_function"}
    assert any("softmax_xentropy_fwd" in t for t in targets), targets
    assert any("softmax_xentropy_bwd" in t for t in targets), targets


@pytest.mark.parametrize("padding_idx", [0, None])
@pytest.mark.parametrize("shape", [(6, 33), (2, 3, 17)], ids=str)
def test_xentropy_opcheck(padding_idx, shape):
    """Schema, fake implementations (output shapes, dtypes, strides), autograd registration and AOT dispatch
    (dynamic shapes) of both registered ops, on the CPU."""
    import apex

    x = torch.randn(*shape, requires_grad=True)
    lab = torch.randint(0, shape[-1], shape[:-1])
    g = torch.randn(shape[:-1])
    with apex.backend("torch"):
        _, lse = torch.ops.apex.softmax_xentropy_fwd(x.detach(), lab, 0.1, padding_idx)
        for op, args in ((torch.ops.apex.softmax_xentropy_fwd.default, (x, lab, 0.1, padding_idx)),
                         (torch.ops.apex.softmax_xentropy_bwd.default, (g, x.detach(), lse, lab, 0.1, padding_idx))):
            result = torch.library.opcheck(op, args)
            assert set(result.values()) == {"SUCCESS"}, (op, result)



def test_xentropy_dispatch_modes_see_the_registered_ops(backend_name, device):
    """Under a dispatch mode the loss and its backward are the registered ops, with eager's values bit for bit;
    under FakeTensorMode the call gives Apex's output (fp32 losses of the rows' shape) without running a
    kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    x, lab, dy = _compile_inputs(device)
    ref = SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False)
    (ref_dx,) = torch.autograd.grad(ref, x, dy)
    with _Recorder() as rec:
        got = SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False)
        (dx,) = torch.autograd.grad(got, x, dy)
    assert {"apex::softmax_xentropy_fwd", "apex::softmax_xentropy_bwd"} <= rec.ops, rec.ops
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, ref_dx, rtol=0, atol=0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = SoftmaxCrossEntropyLoss.apply(x.detach().half(), lab, 0.1, 0, True)
    assert fake.shape == lab.shape and fake.dtype == torch.float32


def test_xentropy_torch_func_grad(backend_name, device):
    """torch.func.grad differentiates the loss (through the registered op's autograd) to eager's gradient."""
    from apex.contrib.xentropy import SoftmaxCrossEntropyLoss

    x, lab, dy = _compile_inputs(device)
    (ref_dx,) = torch.autograd.grad(SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0, False), x, dy)
    dx = torch.func.grad(lambda t: (SoftmaxCrossEntropyLoss.apply(t, lab, 0.1, 0, False) * dy).sum())(x.detach())
    assert_rel_close(dx, ref_dx, tol=1e-6, name="dx")


def test_xentropy_backward_takes_the_forwards_path(triton_device):
    """The eager backward launches with the forward's choice (it does not ask the backend again): a Triton-path
    forward is differentiated by the kernel even where the backward runs under another backend setting, a
    PyTorch-path forward by the PyTorch path; the gradient matches the float64 reference either way."""
    import apex
    from apex.testing import TritonTrace

    if triton_device.type == "meta":
        pytest.skip("compares computed values")
    x = torch.randn(6, 11, device=triton_device, requires_grad=True)
    lab = torch.tensor([1, 0, 10, 4, 0, 7], device=triton_device)
    dy = torch.rand(6, device=triton_device) + 0.5
    x64 = x.detach().double().requires_grad_()
    ref = F.cross_entropy(x64, lab, reduction="none", label_smoothing=0.1, ignore_index=0)
    (rdx,) = torch.autograd.grad(ref, x64, dy.double())
    for forward_backend, backward_backend, launches in (("triton", "torch", 2), ("torch", "triton", 0)):
        with TritonTrace().watch(x, dy) as tr:
            with apex.backend(forward_backend):
                loss = X.SoftmaxCrossEntropyLoss.apply(x, lab, 0.1, 0)
            with apex.backend(backward_backend):
                (dx,) = torch.autograd.grad(loss, x, dy)
        assert tr.launches == launches, (forward_backend, tr.launches)
        assert_rel_close(dx, rdx, torch.float32, tol=1e-6)
