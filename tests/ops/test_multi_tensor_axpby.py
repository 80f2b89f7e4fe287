import amp_C
import pytest
import torch

from apex.testing import TritonTrace, assert_rel_close
from tests.ops._lists import CHUNK_SIZES, flag, ragged

TRIPLES = [(torch.float32, torch.float32, torch.float32), (torch.float16, torch.float32, torch.float16),
           (torch.bfloat16, torch.bfloat16, torch.float32), (torch.float32, torch.float16, torch.bfloat16)]


def _run(backend_name, noop, xs, ys, outs, a, b, arg, chunk_size=2048 * 32):
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(xs, ys, outs, noop)
            amp_C.multi_tensor_axpby(chunk_size, noop, [xs, ys, outs], a, b, arg)
        assert tr.launches == 1
    else:
        amp_C.multi_tensor_axpby(chunk_size, noop, [xs, ys, outs], a, b, arg)


@pytest.mark.parametrize("dtypes", TRIPLES)
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_axpby_matches_float64(backend_name, dtypes, chunk_size):
    xd, yd, od = dtypes
    xs, ys = ragged(xd, seed=1), ragged(yd, seed=2)
    outs = [torch.empty(x.shape, dtype=od) for x in xs]
    noop = flag()
    _run(backend_name, noop, xs, ys, outs, 1.25, -0.75, -1, chunk_size)
    assert noop.item() == 0
    for x, y, o in zip(xs, ys, outs):
        ref = 1.25 * x.double() - 0.75 * y.double()
        assert_rel_close(o, ref, baseline=ref.to(od))


@pytest.mark.parametrize("arg_to_check,bad_in,expect", [(-1, "x", 1), (-1, "y", 1), (0, "x", 1), (0, "y", 0),
                                                        (1, "x", 0), (1, "y", 1)])
def test_axpby_arg_to_check(backend_name, arg_to_check, bad_in, expect):
    xs, ys = ragged(torch.float32, seed=1), ragged(torch.float32, seed=2)
    (xs if bad_in == "x" else ys)[3][77] = float("nan")
    outs = [torch.empty_like(x) for x in xs]
    noop = flag()
    _run(backend_name, noop, xs, ys, outs, 2.0, 3.0, arg_to_check)
    assert noop.item() == expect
    for x, y, o in zip(xs[:3], ys[:3], outs[:3]):
        assert_rel_close(o, 2.0 * x.double() + 3.0 * y.double())


def test_axpby_rejects_bad_arg_to_check():
    xs = ragged(torch.float32, sizes=(3,))
    with pytest.raises(ValueError, match="arg_to_check"):
        amp_C.multi_tensor_axpby(2048, flag(), [xs, xs, xs], 1.0, 1.0, 2)


def test_largest_finite_values_do_not_set_the_flag(backend_name):
    # The non-finite check must see inf/NaN only: values near fp32's maximum (whose squares overflow fp32)
    # are finite, and so is their result here.
    x = [torch.full((300,), 3.0e38), torch.full((7,), -3.3e38)]
    y = [torch.full((300,), 1.0e38), torch.ones(7)]
    out = [torch.empty(300), torch.empty(7)]
    flag = torch.zeros(1, dtype=torch.int32)
    amp_C.multi_tensor_axpby(2048 * 32, flag, [x, y, out], 0.5, 0.25, -1)
    assert flag.item() == 0
    assert torch.equal(out[0], torch.full((300,), 0.5 * 3.0e38 + 0.25 * 1.0e38))
    y[1][3] = float("nan")
    amp_C.multi_tensor_axpby(2048 * 32, flag, [x, y, out], 0.5, 0.25, 1)
    assert flag.item() == 1
