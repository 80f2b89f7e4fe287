"""apex.ops.index_mul_2d: output, gradients and double-backward against float64 on both backends."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex.ops import index_mul_2d as IM
from apex.testing import assert_rel_close
from tests.ops._norms import DTYPES, trace


def _inputs(r, m, f, dtype):
    in1 = torch.randn(r, f).to(dtype)
    in2 = torch.randn(m, f).to(dtype)
    idx = torch.randint(0, r, (m,))
    return in1, in2, idx


def _energy_and_force(fn, in1, in2, idx):
    """Apex's test: an energy, its gradient in in1 ("force") with create_graph, then a second backward."""
    a = in1.detach().clone().requires_grad_()
    b = in2.detach().clone().requires_grad_()
    out = fn(a, b, idx)
    energy = (out.double() ** 2).sum() / out.numel()
    (force,) = torch.autograd.grad(energy, a, create_graph=True)
    loss = energy + (force.double() ** 2).sum()
    ga, gb = torch.autograd.grad(loss, [a, b])
    return out, force, ga, gb


def _ref(in1, in2, idx):
    return _energy_and_force(lambda a, b, i: a[i] * b, in1.double(), in2.double(), idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("r,m,f", [(1, 1, 1), (7, 50, 33), (30, 9, 130)], ids=str)
def test_index_mul_2d_first_and_second_derivatives(backend_name, r, m, f, dtype):
    in1, in2, idx = _inputs(r, m, f, dtype)
    with trace(backend_name, in1, in2, idx):
        got = _energy_and_force(IM.index_mul_2d, in1, in2, idx)
    ref = _ref(in1, in2, idx)
    assert got[0].dtype == dtype
    if dtype == torch.float32:
        assert_rel_close(list(got), list(ref), tol=1e-5)
    else:
        # Each stage rounds to the dtype once; the chain has about four such stages.
        tol = 4e-3 if dtype == torch.float16 else 4 * 2 ** -8
        assert_rel_close(list(got), list(ref), tol=tol)


def test_index_mul_2d_repeated_indices_are_deterministic(backend_name):
    in1, in2, _ = _inputs(3, 200, 17, torch.float32)
    idx = torch.randint(0, 3, (200,))
    g = torch.randn(200, 17)
    with trace(backend_name, in1, in2, idx, g):
        a = in1.clone().requires_grad_()
        out = IM.index_mul_2d(a, in2, idx)
        (d1,) = torch.autograd.grad(out, a, g)
        a2 = in1.clone().requires_grad_()
        (d2,) = torch.autograd.grad(IM.index_mul_2d(a2, in2, idx), a2, g)
    assert torch.equal(d1, d2)
    ref = torch.zeros(3, 17, dtype=torch.float64).index_add_(0, idx, g.double() * in2.double())
    assert_rel_close(d1, ref, tol=1e-6)


def test_index_mul_2d_non_contiguous(backend_name):
    in1 = torch.randn(20, 8)[::2]
    in2 = torch.randn(6, 16)[:, ::2]
    idx = torch.tensor([0, 9, 3, 3, 9, 1])
    with trace(backend_name, in1, in2, idx):
        got = _energy_and_force(IM.index_mul_2d, in1, in2, idx)
    assert_rel_close(list(got), list(_ref(in1, in2, idx)), tol=1e-5)


def test_index_mul_2d_apex_entry_points(backend_name):
    import fused_index_mul_2d as ext

    from apex.contrib.index_mul_2d import index_mul_2d

    in1, in2, idx = _inputs(5, 12, 7, torch.float16)
    out = torch.empty_like(in2)
    ext.half_forward(out, in1, in2, idx)
    assert_rel_close(out, in1.double()[idx] * in2.double(), tol=1e-3)
    g = torch.randn(12, 7).half()
    gi1, gi2 = torch.zeros_like(in1), torch.empty_like(in2)
    ext.half_backward(gi1, gi2, g, in1, in2, idx)
    ref1 = torch.zeros(5, 7, dtype=torch.float64).index_add_(0, idx, g.double() * in2.double())
    assert_rel_close([gi1, gi2], [ref1, g.double() * in1.double()[idx]], tol=2e-3)
    gg1, gg2 = torch.randn(5, 7).half(), torch.randn(12, 7).half()
    ggo, g1, g2 = torch.empty_like(g), torch.zeros_like(in1), torch.empty_like(in2)
    ext.half_backward_backward(ggo, g1, g2, g, gg1, gg2, in1, in2, idx)
    d = lambda t: t.double()  # noqa: E731
    assert_rel_close(ggo, d(gg1)[idx] * d(in2) + d(in1)[idx] * d(gg2), tol=2e-3)
    assert_rel_close(g1, torch.zeros(5, 7, dtype=torch.float64).index_add_(0, idx, d(g) * d(gg2)), tol=2e-3)
    assert_rel_close(g2, d(gg1)[idx] * d(g), tol=2e-3)
    a = in1.float().requires_grad_()
    assert_rel_close(index_mul_2d(a, in2.float(), idx), d(in1)[idx] * d(in2), tol=1e-6)


@pytest.mark.parametrize("which", ["grad_out", "grad_grad_in1", "grad_grad_in2"])
def test_index_mul_2d_entry_points_refuse_tensors_on_another_device(backend_name, device, which):
    """fused_index_mul_2d's backward entries refuse a gradient on another device than in1 (``meta`` standing
    in), naming it, before a kernel reads it; the output buffers keep their values."""
    import fused_index_mul_2d as ext

    in1, in2, idx = (t.to(device) for t in _inputs(5, 12, 7, torch.float32))
    args = {"grad_out": torch.randn(12, 7, device=device), "grad_grad_in1": torch.randn(5, 7, device=device),
            "grad_grad_in2": torch.randn(12, 7, device=device)}
    args[which] = args[which].to("meta")
    ggo, g1, g2 = torch.zeros(12, 7, device=device), torch.zeros_like(in1), torch.zeros_like(in2)
    with pytest.raises(ValueError, match=f"{which} is on meta"):
        if which == "grad_out":
            ext.float_backward(g1, g2, args["grad_out"], in1, in2, idx)
        else:
            ext.float_backward_backward(ggo, g1, g2, args["grad_out"], args["grad_grad_in1"], args["grad_grad_in2"],
                                        in1, in2, idx)
    assert not (ggo.any() or g1.any() or g2.any())


def test_index_mul_2d_bad_input_raises():
    in1, in2, idx = _inputs(4, 6, 3, torch.float32)
    with pytest.raises(ValueError, match=r"idx1 must index in1's rows \[0, 4\)"):
        IM.index_mul_2d(in1, in2, torch.tensor([0, 1, 2, 4, 0, 1]))
    with pytest.raises(ValueError, match=r"idx1 must index"):
        IM.index_mul_2d(in1, in2, torch.tensor([0, 1, -1, 3, 0, 1]))
    with pytest.raises(ValueError, match="idx1 must be 1-D with in2's 6 rows"):
        IM.index_mul_2d(in1, in2, idx[:3])
    with pytest.raises(TypeError, match="same dtype"):
        IM.index_mul_2d(in1, in2.half(), idx)
    with pytest.raises(ValueError, match="same number of columns"):
        IM.index_mul_2d(in1, torch.randn(6, 4), idx)
    with pytest.raises(ValueError, match="in1 must be a 2-D"):
        IM.index_mul_2d(torch.randn(4), in2, idx)
    with pytest.raises(TypeError, match="idx1 must be an int64"):
        IM.index_mul_2d(in1, in2, idx.float())
    out = torch.full_like(in2, 7.0)
    with pytest.raises(ValueError):
        IM.float_forward(out, in1, in2, torch.tensor([0, 1, 2, 9, 0, 1]))
    assert (out == 7.0).all()


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(r=st.integers(1, 12), m=st.integers(1, 60), f=st.integers(1, 40))
def test_index_mul_2d_random_shapes(backend_name, r, m, f):
    torch.manual_seed(r * 10000 + m * 100 + f)
    in1, in2, idx = _inputs(r, m, f, torch.float32)
    with trace(backend_name, in1, in2, idx):
        got = _energy_and_force(IM.index_mul_2d, in1, in2, idx)
    assert_rel_close(list(got), list(_ref(in1, in2, idx)), tol=1e-5)


def test_triton_backward_runs_only_the_sort(backend_name):
    """The segment sum's kernel finds each target row's segment by binary search in the sorted indices: a
    step issues no PyTorch operator but the sort (no counting, scan or bounds buffer), made in the forward;
    no index check reads anything on the host."""
    from apex._backend import interpreting
    from apex.testing import count_eager

    if backend_name != "triton":
        pytest.skip("the PyTorch path is PyTorch operators by design")
    in1, in2 = torch.randn(32, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    idx = torch.tensor([3, 0, 3, 31, 7, 3, 0] + [5] * 13)
    gy = torch.randn(20, 8)
    counts = count_eager(lambda: torch.autograd.grad(IM.index_mul_2d(in1, in2, idx), (in1, in2), gy))["ops"]
    if interpreting():
        counts.pop("copy_", None)  # the interpreter's transfers between tensors and its numpy arrays
    assert counts == {"sort": 1}  # and no host read (on a GPU, a device-to-host copy)


def test_index_out_of_range(backend_name):
    """An index outside in1's rows. PyTorch path: ValueError naming the range, with and without a gradient to
    record (both ends, one row or several). Triton path: no host read, that output row NaN, the row adds
    nothing to in1's gradient and gets a zero in2 gradient, every other row exact; the same through the
    double backward's products."""
    in1, in2 = torch.randn(4, 3, requires_grad=True), torch.randn(6, 3, requires_grad=True)
    cases = (([0, 4], r"\[0, 4\]"), ([2, -1], r"\[-1, 2\]"), ([5, 7], r"\[5, 7\]"), ([4], r"\[4, 4\]"),
             ([-3, 1, 9, 0, 1, -1], r"\[-3, 9\]"))
    for bad, got in cases:
        idx, b = torch.tensor(bad), in2[:len(bad)]
        if backend_name == "torch":
            for grad in (True, False):
                with torch.set_grad_enabled(grad), \
                        pytest.raises(ValueError, match=r"idx1 must index in1's rows \[0, 4\), got values in " + got):
                    IM.index_mul_2d(in1, b, idx)
            continue
        ok = (idx >= 0) & (idx < 4)
        ref = in1.detach().double()[idx.clamp(0, 3)] * b.detach().double()
        for grad in (False, True):  # the last y has a graph
            with torch.set_grad_enabled(grad):
                y = IM.index_mul_2d(in1, b, idx)
            assert y[~ok].isnan().all()
            assert_rel_close(y[ok], ref[ok], tol=1e-6)
        gy = torch.randn_like(b)
        g1, g2 = torch.autograd.grad(y, (in1, b), gy)
        ref1 = torch.zeros(4, 3, dtype=torch.float64).index_add_(0, idx[ok], gy.double()[ok] * b.detach().double()[ok])
        assert_rel_close(g1, ref1, tol=1e-6)
        assert (g2[~ok] == 0).all()
        assert_rel_close(g2[ok], gy.double()[ok] * in1.detach().double()[idx[ok]], tol=1e-6)
        # create_graph: the gradients through the double-backward Function, the same values
        y = IM.index_mul_2d(in1, b, idx)
        h1, h2 = torch.autograd.grad(y, (in1, b), gy, create_graph=True)
        assert torch.equal(h1, g1) and torch.equal(h2, g2)


def test_without_gradient_records_nothing(backend_name, monkeypatch):
    """Under no_grad the product runs without the autograd Function (no context, nothing saved), with the
    same values and the same argument checks."""
    in1, in2 = torch.randn(6, 4, requires_grad=True), torch.randn(5, 4)
    idx = torch.tensor([0, 5, 2, 2, 1])
    ref = IM.index_mul_2d(in1, in2, idx)

    def refuse(*args):
        raise AssertionError("the autograd Function ran without a gradient to record")

    monkeypatch.setattr(IM.IndexMul2d, "forward", staticmethod(refuse))
    with torch.no_grad():
        out = IM.index_mul_2d(in1, in2, idx)
        with pytest.raises(ValueError, match="idx1 must be 1-D"):
            IM.index_mul_2d(in1, in2, idx[:4])
    assert out.grad_fn is None and torch.equal(out, ref.detach())


def test_index_range_check_makes_one_host_read(monkeypatch):
    """Without a gradient to record, idx1's range is one host read: idx1 clamped to the rows and compared with
    itself (``torch.equal``), no reduction; the extremes are read for the message only when one is out of
    range."""
    in1, in2 = torch.randn(4, 3), torch.randn(3, 3)
    reads = []
    equal, aminmax = torch.equal, torch.Tensor.aminmax
    monkeypatch.setattr(torch, "equal", lambda a, b: reads.append("equal") or equal(a, b))
    monkeypatch.setattr(torch.Tensor, "aminmax", lambda t: reads.append("aminmax") or aminmax(t))
    with torch.no_grad():
        for idx in ([0, 3, 3], [3, 0, 1]):  # both ends of the range
            IM.index_mul_2d(in1, in2, torch.tensor(idx))
            assert reads == ["equal"]
            reads.clear()
        for bad, got in (([0, 4, 1], r"\[0, 4\]"), ([2, -1, 0], r"\[-1, 2\]")):
            with pytest.raises(ValueError, match=r"idx1 must index in1's rows \[0, 4\), got values in " + got):
                IM.index_mul_2d(in1, in2, torch.tensor(bad))
            assert reads == ["equal", "aminmax"]
            reads.clear()


def test_triton_path_sorts_an_unchanged_index_once(backend_name, monkeypatch):
    """The Triton path's stable sort of idx1 (IndexOrders) is made once while idx1 is the same unchanged
    tensor, and every change is noticed: in place, through a view, ``.data`` and ``set_`` (a stale sort
    is a wrong gradient: values asserted). int32 indices too; inference tensors (no version counter) are
    sorted every call; an entry holds no reference to its tensor and goes with it."""
    import gc
    import weakref

    from apex.testing import count_eager

    if backend_name != "triton":
        pytest.skip("the PyTorch path sorts nothing")
    orders = IM.IndexOrders(size=4)
    monkeypatch.setattr(IM, "_ORDERS", orders)
    in1, in2 = torch.randn(8, 4, requires_grad=True), torch.randn(6, 4, requires_grad=True)
    gy = torch.randn(6, 4)

    def sorts(idx):
        """One forward and backward: the gradients checked, the sorts it made returned."""
        def step():
            return torch.autograd.grad(IM.index_mul_2d(in1, in2, idx), (in1, in2), gy)

        counts = count_eager(step)["ops"]
        g1, g2 = step()
        i = idx.long()
        ref1 = torch.zeros(8, 4, dtype=torch.float64).index_add_(0, i, gy.double() * in2.detach().double())
        assert_rel_close(g1, ref1, tol=1e-6)
        assert_rel_close(g2, gy.double() * in1.detach().double()[i], tol=1e-6)
        return counts.get("sort", 0)

    idx = torch.tensor([3, 0, 3, 7, 1, 0])
    assert sorts(idx) == 1 and sorts(idx) == 0  # (count_eager's call and the checked one: one sort)
    idx[0] = 5
    assert sorts(idx) == 1
    idx[2:].fill_(6)  # through a view: the version counter is shared
    assert sorts(idx) == 1
    idx.data = torch.tensor([1, 1, 2, 2, 0, 0])
    assert sorts(idx) == 1
    idx.set_(torch.tensor([7, 6, 5, 4, 3, 2]))
    assert sorts(idx) == 1 and sorts(idx) == 0
    j = torch.tensor([2, 2, 1, 0, 4, 4], dtype=torch.int32)  # its int64 form kept with the sort
    assert sorts(j) == 1 and sorts(j) == 0
    with torch.inference_mode():  # (an int64 one could not be saved for the backward: int32)
        k = torch.tensor([0, 1, 0, 1, 0, 1], dtype=torch.int32)
    assert sorts(k) == 1 and sorts(k) == 1
    assert len(orders._entries) == 2  # idx and j
    alive = weakref.ref(idx)
    del idx, j
    gc.collect()
    # (what still holds it, if anything: seen once only under compute-sanitizer, in one process of many tests)
    assert alive() is None, [type(r).__name__ for r in gc.get_referrers(alive())]
    assert not orders._entries
    for n in range(6):  # at most `size` entries, the oldest dropped
        assert sorts(torch.full((6,), n)) == 1
    assert len(orders._entries) == 0  # each temporary went with its tensor
    kept = [torch.full((6,), n) for n in range(6)]
    for t in kept:
        sorts(t)
    assert len(orders._entries) == 4 and sorts(kept[-1]) == 0 and sorts(kept[0]) == 1
