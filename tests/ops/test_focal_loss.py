"""apex.ops.focal_loss: loss and gradient against a float64 autograd reference on both backends."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex.ops import focal_loss as FL
from apex.testing import assert_rel_close
from tests.ops._norms import DTYPES, trace


def _inputs(m, k, k_real, dtype):
    x = (torch.randn(m, k) * 2).to(dtype)
    y = torch.randint(0, k_real, (m,))
    r = torch.rand(m)
    y[r < 0.3] = -1
    y[(r >= 0.3) & (r < 0.45)] = -2
    npos = torch.tensor([float(max(1, int((y >= 0).sum())))])
    return x, y, npos


def _ref(x, y, npos, k_real, alpha, gamma, smoothing, dy=1.0):
    """Float64 autograd of the loss written from its definition (BCE against smoothed targets)."""
    p = x.detach().double().requires_grad_()
    k = x.shape[-1]
    pos = F.one_hot(y.clamp(min=0), k).bool() & (y >= 0)[:, None]
    t = torch.where(pos, 1 - smoothing / 2, smoothing / 2)
    bce = F.binary_cross_entropy_with_logits(p, t.double(), reduction="none")
    sig = torch.sigmoid(p)
    w = torch.where(pos, alpha * (1 - sig) ** gamma, (1 - alpha) * sig ** gamma)
    valid = (y != -2)[:, None] & (torch.arange(k) < k_real)[None, :]
    loss = torch.where(valid, w * bce, 0).sum() / npos.double().reshape(())
    (g,) = torch.autograd.grad(loss, p, torch.tensor(dy, dtype=torch.float64))
    return loss.detach(), g


def _run(x, y, npos, k_real, alpha, gamma, smoothing, dy=1.0):
    leaf = x.clone().requires_grad_()
    loss = FL.focal_loss(leaf, y, npos, k_real, alpha, gamma, smoothing)
    (g,) = torch.autograd.grad(loss, leaf, torch.tensor(dy))
    return loss, g


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (700, 96): several programs' partial sums (the others: one program, which normalises the loss itself)
@pytest.mark.parametrize("m,k,k_real", [(1, 1, 1), (37, 13, 11), (20, 96, 91), (700, 96, 91)], ids=str)
def test_focal_loss_matches_float64(backend_name, m, k, k_real, dtype, smoothing):
    x, y, npos = _inputs(m, k, k_real, dtype)
    with trace(backend_name, x, y, npos) as tr:
        loss, g = _run(x, y, npos, k_real, 0.25, 2.0, smoothing, 0.7)
    if tr is not None:
        assert tr.launches == 2
    ref_l, ref_g = _ref(x, y, npos, k_real, 0.25, 2.0, smoothing, 0.7)
    assert loss.dtype == torch.float32 and loss.dim() == 0 and g.dtype == dtype
    assert_rel_close(loss, ref_l, tol=1e-5, name="loss")
    # The gradient is stored once in the logits' dtype (as Apex): one rounding of that dtype.
    tol = 1e-5 if dtype == torch.float32 else (2e-3 if dtype == torch.float16 else 2 * 2 ** -8)
    assert_rel_close(g, ref_g, tol=tol, name="grad")
    assert (g[y == -2] == 0).all() and (g[:, k_real:] == 0).all()


@pytest.mark.parametrize("gamma", [0.0, 1.0, 1.5])
def test_focal_loss_gamma_values_and_batched_shape(backend_name, gamma):
    x, y, npos = _inputs(24, 9, 9, torch.float32)
    x3, y3 = x.reshape(2, 12, 9), y.reshape(2, 12)
    with trace(backend_name, x3, y3, npos):
        leaf = x3.clone().requires_grad_()
        loss = FL.focal_loss(leaf, y3, npos, 9, 0.4, gamma, 0.05)
        (g,) = torch.autograd.grad(loss, leaf)
    ref_l, ref_g = _ref(x, y, npos, 9, 0.4, gamma, 0.05)
    assert_rel_close(loss, ref_l, tol=1e-5)
    assert_rel_close(g.reshape(24, 9), ref_g, tol=1e-5)


def test_focal_loss_apex_entry_points_and_module(backend_name):
    import focal_loss_cuda

    from apex.contrib.focal_loss import focal_loss

    x, y, npos = _inputs(16, 8, 8, torch.float16)
    loss, partial = focal_loss_cuda.forward(x, y, npos, 8, 0.25, 2.0, 0.0)
    ref_l, ref_g = _ref(x, y, npos, 8, 0.25, 2.0, 0.0, 2.0)
    assert_rel_close(loss, ref_l, tol=1e-5)
    g = focal_loss_cuda.backward(torch.tensor(2.0), partial, npos)
    assert g.data_ptr() == partial.data_ptr()  # in place, as Apex
    assert_rel_close(g, ref_g, tol=2e-3)
    leaf = x.clone().requires_grad_()
    out = focal_loss.FocalLoss.apply(leaf, y, npos, 8, 0.25, 2.0, 0.0)
    out.backward()
    assert_rel_close(leaf.grad, ref_g / 2, tol=2e-3)


def test_focal_loss_second_backward_is_refused():
    x, y, npos = _inputs(5, 4, 4, torch.float32)
    leaf = x.clone().requires_grad_()
    loss = FL.focal_loss(leaf, y, npos, 4, 0.25, 2.0)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_focal_loss_bad_input_raises():
    x, y, npos = _inputs(6, 5, 5, torch.float32)
    with pytest.raises(ValueError, match=r"got 5"):
        FL.focal_loss(x, torch.tensor([0, 1, 5, -1, -2, 0]), npos, 5, 0.25, 2.0)
    with pytest.raises(ValueError, match=r"got -3"):
        FL.focal_loss(x, torch.tensor([0, 1, -3, -1, -2, 0]), npos, 5, 0.25, 2.0)
    with pytest.raises(TypeError, match="int64"):
        FL.focal_loss(x, y.int(), npos, 5, 0.25, 2.0)
    with pytest.raises(ValueError, match=r"must have shape \[6\]"):
        FL.focal_loss(x, y[:3], npos, 5, 0.25, 2.0)
    with pytest.raises(ValueError, match="num_real_classes"):
        FL.focal_loss(x, y, npos, 6, 0.25, 2.0)
    with pytest.raises(ValueError, match="num_positives_sum"):
        FL.focal_loss(x, y, torch.ones(2), 5, 0.25, 2.0)


@pytest.mark.parametrize("which", ["grad_output", "num_positives_sum"])
def test_focal_loss_backward_refuses_tensors_on_another_device(backend_name, device, which):
    """The backward refuses a gradient or N⁺ on another device than partial_grad (``meta`` standing in),
    naming it, before a kernel reads it; partial_grad, which it scales in place, keeps its values."""
    x, y, npos = (t.to(device) for t in _inputs(6, 5, 5, torch.float32))
    _, partial = FL.focal_loss_forward(x, y, npos, 5, 0.25, 2.0)
    args = {"grad_output": torch.ones((), device=device), "num_positives_sum": npos}
    args[which] = args[which].to("meta")
    before = partial.clone()
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        FL.focal_loss_backward(args["grad_output"], partial, args["num_positives_sum"])
    assert torch.equal(partial, before)


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(m=st.integers(1, 30), k=st.integers(1, 40))
def test_focal_loss_random_shapes(backend_name, m, k):
    torch.manual_seed(m * 100 + k)
    k_real = max(1, k - 2)
    x, y, npos = _inputs(m, k, k_real, torch.float32)
    with trace(backend_name, x, y, npos):
        loss, g = _run(x, y, npos, k_real, 0.25, 2.0, 0.1)
    ref_l, ref_g = _ref(x, y, npos, k_real, 0.25, 2.0, 0.1)
    assert_rel_close(loss, ref_l, tol=1e-5)
    assert_rel_close(g, ref_g, tol=1e-5)


@pytest.mark.parametrize("m", [6, 700])  # one program, several programs' partial sums
def test_focal_loss_target_out_of_range(backend_name, m):
    """A target outside [-2, num_real_classes). PyTorch path: ValueError naming it, with and without a gradient
    to record. Triton path: no host read; a NaN loss, a zero gradient for that row and every other row's
    gradient as without it."""
    x, y, npos = _inputs(m, 5, 4, torch.float32)
    for bad in (4, 5, -3):
        yb = y.clone()
        yb[m // 2] = bad
        if backend_name == "torch":
            for grad in (True, False):
                with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=f"got {bad}"):
                    FL.focal_loss(x.clone().requires_grad_(grad), yb, npos, 4, 0.25, 2.0)
            continue
        with torch.no_grad():
            assert FL.focal_loss(x, yb, npos, 4, 0.25, 2.0).isnan()
        loss, g = _run(x, yb, npos, 4, 0.25, 2.0, 0.1)
        assert loss.isnan()
        assert (g[m // 2] == 0).all()
        yi = yb.clone()
        yi[m // 2] = -2  # the row ignored: the other rows' gradients
        assert_rel_close(g, _ref(x, yi, npos, 4, 0.25, 2.0, 0.1)[1], tol=1e-5)


def test_triton_path_runs_no_operator(backend_name):
    """A step of the Triton path issues no PyTorch operator and reads nothing on the host (no target check):
    the single program normalises the loss, the backward reads the scale's tensors itself."""
    from apex._backend import interpreting
    from apex.testing import count_eager

    if backend_name != "triton":
        pytest.skip("the PyTorch path is PyTorch operators by design")
    x, y, npos = _inputs(16, 96, 80, torch.float32)
    x.requires_grad_()
    counts = count_eager(lambda: FL.focal_loss(x, y, npos, 80, 0.25, 2.0).backward())["ops"]
    if interpreting():
        counts.pop("copy_", None)  # the interpreter's transfers between tensors and its numpy arrays
    assert counts == {}


def test_without_gradient_records_nothing(backend_name, monkeypatch):
    """Under no_grad the loss is computed without the autograd Function (no context, no saved partial
    gradient), with the same value."""
    x, y, npos = _inputs(20, 96, 91, torch.float32)
    ref = FL.focal_loss(x.clone().requires_grad_(), y, npos, 91, 0.25, 2.0, 0.1)

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(FL.FocalLoss, "forward", staticmethod(refuse))
    with torch.no_grad():
        loss = FL.focal_loss(x, y, npos, 91, 0.25, 2.0, 0.1)
    assert loss.grad_fn is None and torch.equal(loss, ref.detach())
