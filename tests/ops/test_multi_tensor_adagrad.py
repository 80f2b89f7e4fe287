"""amp_C.multi_tensor_adagrad against float64 in both modes, launches and bytes."""

import amp_C
import pytest
import torch

from apex.testing import TritonTrace, assert_rel_close
from tests.ops._lists import flag, ragged

SIZES = (1, 7, 4097, 65537)


def _ref(g, p, h, mode, lr=0.05, eps=1e-10, wd=0.1):
    g, p, h = g.double(), p.double(), h.double()
    if mode == 0:
        g = g + wd * p
        h = h + g * g
        return p - lr * g / (h.sqrt() + eps), h
    h = h + g * g
    return p - lr * (g / (h.sqrt() + eps) + wd * p), h


@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_adagrad_matches_float64(backend_name, mode, dtype):
    g, p = ragged(dtype, SIZES, 0), ragged(dtype, SIZES, 1)
    h = [x.abs() for x in ragged(dtype, SIZES, 2)]
    refs = [_ref(*t, mode) for t in zip(g, p, h)]
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(g, p, h)
            amp_C.multi_tensor_adagrad(2048, flag(), [g, p, h], 0.05, 1e-10, mode, 0.1)
        assert tr.launches == 1
    else:
        amp_C.multi_tensor_adagrad(2048, flag(), [g, p, h], 0.05, 1e-10, mode, 0.1)
    for x, hh, (rp, rh) in zip(p, h, refs):
        assert_rel_close(x, rp, baseline=rp.to(dtype))
        assert_rel_close(hh, rh, baseline=rh.to(dtype))


def test_triton_moves_the_minimum_bytes(triton_device):
    pytest.importorskip("triton")
    import apex

    g, p, h = ragged(torch.float32, SIZES, 0), ragged(torch.float32, SIZES, 1), ragged(torch.float32, SIZES, 2)
    h = [x.abs() for x in h]
    n = sum(x.numel() for x in p)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        tr.watch(g, p, h)
        amp_C.multi_tensor_adagrad(2048, flag(), [g, p, h], 0.05, 1e-10, 0, 0.1)
    assert tr.launches == 1
    assert 20 * n <= tr.bytes_requested <= 1.01 * 20 * n, tr.bytes_requested / n


def test_bad_mode():
    xs = ragged(torch.float32, (3,))
    with pytest.raises(ValueError, match="mode"):
        amp_C.multi_tensor_adagrad(2048, flag(), [xs, xs, xs], 0.1, 1e-10, 2, 0.0)
