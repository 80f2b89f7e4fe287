import amp_C
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from apex.testing import TritonTrace, assert_rel_close
from tests.ops._lists import CHUNK_SIZES, flag, mixed, ragged


def _norms64(xs, ord=2.0):
    per = torch.stack([torch.linalg.vector_norm(x.double().reshape(-1), ord) if x.numel()
                       else torch.zeros((), dtype=torch.float64) for x in xs])
    total = per.max() if ord == float("inf") else torch.linalg.vector_norm(per)
    return total.reshape(1), per


def _call(backend_name, fn, *args, watch=(), launches=None):
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(*watch, *args)
            result = fn(*args)
        if launches is not None:
            assert tr.launches == launches
        return result
    return fn(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_matches_float64(backend_name, dtype, chunk_size, per_tensor):
    xs = ragged(dtype, scale=2.0)
    noop = flag()
    total, per = _call(backend_name, amp_C.multi_tensor_l2norm, chunk_size, noop, [xs], per_tensor,
                       watch=[xs, noop], launches=2)
    ref_total, ref_per = _norms64(xs)
    assert noop.item() == 0
    assert total.dtype == torch.float32 and total.shape == (1,)
    assert_rel_close(total, ref_total, torch.float32, tol=1e-5)
    if per_tensor:
        assert_rel_close(per, ref_per, torch.float32, tol=1e-5)
    else:
        assert per.numel() == 0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-5)])
def test_cpu_norms_of_long_tensors_keep_fp32_accuracy(dtype, tol):
    """PyTorch's own CPU norm of a 10M-element tensor is off by about 4e-4 in fp32 and 1e-4 from bf16
    (one fp32 accumulator per lane); the PyTorch path stays at fp32 accuracy for long and short tensors
    in one list."""
    import apex

    gen = torch.Generator().manual_seed(0)
    xs = [(torch.randn(n, generator=gen) + 0.5).to(dtype) for n in (10_000_003, 5, 40_000, 3 * 32768)]
    ref = torch.stack([torch.linalg.vector_norm(x.double()) for x in xs])
    with apex.backend("torch"):
        total, per = amp_C.multi_tensor_l2norm(2048, flag(), [xs], True)
    assert_rel_close(per, ref, tol=tol)
    assert_rel_close(total, torch.linalg.vector_norm(ref).reshape(1), tol=tol)


@given(sizes=st.lists(st.sampled_from([0, 1, 5, 32767, 32768, 32769, 70001, 1_500_007]), min_size=1, max_size=5),
       seed=st.integers(0, 1000))
@settings(max_examples=12, deadline=None)
def test_cpu_norms_of_short_and_long_tensors_match_float64(sizes, seed):
    """Tensors on both sides of the row length of the PyTorch path's long-tensor norms, any order."""
    import apex

    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, generator=gen) + 0.5 for n in sizes]
    ref = torch.stack([torch.linalg.vector_norm(x.double()) for x in xs])
    with apex.backend("torch"):
        total, per = amp_C.multi_tensor_l2norm(2048, flag(), [xs], True)
    assert_rel_close(per, ref, tol=1e-6)
    assert_rel_close(total, torch.linalg.vector_norm(ref).reshape(1), tol=1e-6)


def test_l2norm_mixed_dtypes_one_launch_per_group_plus_finalize(backend_name):
    xs = mixed()
    noop = flag()
    total, per = _call(backend_name, amp_C.multi_tensor_l2norm, 2048 * 32, noop, [xs], True,
                       watch=[xs, noop], launches=len({x.dtype for x in xs}) + 1)
    ref_total, ref_per = _norms64(xs)
    assert_rel_close(total, ref_total, tol=1e-5)
    assert_rel_close(per, ref_per, tol=1e-5)


@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_l2norm_flags_nonfinite(backend_name, bad):
    xs = ragged(torch.float16)
    xs[1][3] = float(bad)
    noop = flag()
    total, per = _call(backend_name, amp_C.multi_tensor_l2norm, 2048 * 32, noop, [xs], True, watch=[xs, noop])
    assert noop.item() == 1
    assert not torch.isfinite(total).all() and not torch.isfinite(per[1])
    ref_total, ref_per = _norms64(xs)
    for i in (0, 2, 3):
        assert_rel_close(per[i], ref_per[i], tol=1e-5)


def test_l2norm_results_do_not_depend_on_chunk_size(backend_name):
    xs = ragged(torch.float32)
    outs = [_call(backend_name, amp_C.multi_tensor_l2norm, cs, flag(), [xs], True) for cs in CHUNK_SIZES]
    for t, p in outs[1:]:
        assert torch.equal(t, outs[0][0]) and torch.equal(p, outs[0][1])


def test_l2norm_mp_skips_when_flag_already_set(backend_name):
    xs = ragged(torch.bfloat16)
    noop = flag()
    total, per = _call(backend_name, amp_C.multi_tensor_l2norm_mp, 2048 * 32, noop, [xs], True, watch=[xs, noop])
    assert_rel_close(total, _norms64(xs)[0], tol=1e-5)
    noop.fill_(1)
    total, per = _call(backend_name, amp_C.multi_tensor_l2norm_mp, 2048 * 32, noop, [xs], True, watch=[xs, noop])
    assert total.item() == 0 and per.abs().sum().item() == 0


@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float32),
                                                (torch.bfloat16, torch.bfloat16)])
def test_l2norm_scale_writes_scaled_copy_and_norm_of_input(backend_name, in_dtype, out_dtype):
    xs = ragged(in_dtype)
    outs = [torch.empty(x.shape, dtype=out_dtype) for x in xs]
    noop = flag()
    total, per = _call(backend_name, amp_C.multi_tensor_l2norm_scale, 2048 * 32, noop, [xs, outs], 0.25, True,
                       watch=[xs, outs, noop])
    ref_total, ref_per = _norms64(xs)
    assert_rel_close(total, ref_total, tol=1e-5)
    assert_rel_close(per, ref_per, tol=1e-5)
    for x, o in zip(xs, outs):
        ref = x.double() * 0.25
        assert_rel_close(o, ref, baseline=ref.to(out_dtype))


def test_unscale_l2norm(backend_name):
    xs = ragged(torch.float16, scale=100.0)
    before = [x.clone() for x in xs]
    inv = torch.tensor([1 / 64.0])
    noop = flag()
    total, per = _call(backend_name, amp_C.multi_tensor_unscale_l2norm, 2048 * 32, noop, [xs], inv, True,
                       watch=[xs, noop, inv])
    ref_total, ref_per = _norms64([x.double() / 64.0 for x in xs])
    assert_rel_close(total, ref_total, tol=1e-5)
    assert_rel_close(per, ref_per, tol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(xs, before))


@pytest.mark.parametrize("norm_type", [0, 2])
def test_norm_out_blends(backend_name, norm_type):
    xs = ragged(torch.float32)
    out = torch.rand(len(xs)) + 0.5
    old = out.clone().double()
    noop = flag()
    _call(backend_name, amp_C.multi_tensor_norm_out_cuda, 2048 * 32, noop, [xs], out, 0.9, 0.1, norm_type,
          watch=[xs, noop, out])
    _, n = _norms64(xs, float("inf") if norm_type == 0 else 2.0)
    ref = 0.9 * old + 0.1 * n if norm_type == 0 else torch.sqrt(0.9 * old**2 + 0.1 * n**2)
    assert_rel_close(out, ref, tol=1e-5)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_l2norm_property(backend_name, sizes, dtype):
    xs = ragged(dtype, sizes=sizes, seed=len(sizes))
    total, per = amp_C.multi_tensor_l2norm(2048, flag(), [xs], True)
    ref_total, ref_per = _norms64(xs)
    assert_rel_close(total, ref_total, tol=1e-5)
    assert_rel_close(per, ref_per, tol=1e-5)
