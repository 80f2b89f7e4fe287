"""amp_C.multi_tensor_sgd against float64: every option, the fp16-copy fourth list, noop, launches, bytes."""

import amp_C
import pytest
import torch

from apex.testing import TritonTrace, assert_rel_close
from tests.ops._lists import flag, ragged

SIZES = (1, 7, 4097, 65537)


def _ref(g, w, b, *, wd, momentum, dampening, lr, nesterov, first_run, wd_after, scale):
    g, w, b = g.double() * scale, w.double(), b.double()
    if wd and not wd_after:
        g = g + wd * w
    if momentum:
        b = g.clone() if first_run else b * momentum + (1 - dampening) * g
        g = g + momentum * b if nesterov else b
    if wd and wd_after:
        g = g + wd * w
    return w - lr * g, b


CONFIGS = [
    dict(wd=0.0, momentum=0.0, dampening=0.0, nesterov=False, first_run=False, wd_after=False, scale=1.0),
    dict(wd=0.05, momentum=0.9, dampening=0.0, nesterov=False, first_run=True, wd_after=False, scale=1.0),
    dict(wd=0.05, momentum=0.9, dampening=0.0, nesterov=True, first_run=False, wd_after=False, scale=1.0),
    dict(wd=0.05, momentum=0.9, dampening=0.2, nesterov=False, first_run=False, wd_after=True, scale=0.5),
]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sgd_matches_float64(backend_name, cfg, dtype):
    g, w, b = ragged(dtype, SIZES, 0), ragged(dtype, SIZES, 1), ragged(dtype, SIZES, 2)
    refs = [_ref(*t, lr=0.1, **cfg) for t in zip(g, w, b)]
    lists = [g, w, b]
    args = (cfg["wd"], cfg["momentum"], cfg["dampening"], 0.1, cfg["nesterov"], cfg["first_run"],
            cfg["wd_after"], cfg["scale"])
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(lists)
            amp_C.multi_tensor_sgd(2048, flag(), lists, *args)
        assert tr.launches == 1
    else:
        amp_C.multi_tensor_sgd(2048, flag(), lists, *args)
    for x, bb, (rw, rb) in zip(w, b, refs):
        assert_rel_close(x, rw, baseline=rw.to(dtype))
        if cfg["momentum"]:
            assert_rel_close(bb, rb, baseline=rb.to(dtype))


def test_fourth_list_receives_the_updated_master_and_noop_skips(backend_name):
    g = ragged(torch.float16, SIZES, 0)
    w = [x.float() for x in ragged(torch.float16, SIZES, 1)]
    b = ragged(torch.float32, SIZES, 2)
    model = [torch.empty(x.shape, dtype=torch.float16) for x in w]
    before = [x.clone() for x in w]
    amp_C.multi_tensor_sgd(2048, torch.ones(1, dtype=torch.int32), [g, w, b, model], 0.0, 0.9, 0.0, 0.1,
                           False, False, False, 1.0)
    assert all(torch.equal(x, y) for x, y in zip(w, before))
    amp_C.multi_tensor_sgd(2048, flag(), [g, w, b, model], 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0)
    for x, m, old, gg, bb0 in zip(w, model, before, g, ragged(torch.float32, SIZES, 2)):
        ref = old.double() - 0.1 * (0.9 * bb0.double() + gg.double())
        assert_rel_close(x, ref, torch.float32)
        assert torch.equal(m, x.half())


def test_triton_moves_the_minimum_bytes(triton_device):
    pytest.importorskip("triton")
    import apex

    g, w, b = (ragged(torch.float32, SIZES, s) for s in range(3))
    n = sum(x.numel() for x in w)
    with apex.backend("triton"), TritonTrace(bounds=True) as tr:
        tr.watch(g, w, b)
        amp_C.multi_tensor_sgd(2048, flag(), [g, w, b], 0.01, 0.9, 0.0, 0.1, False, False, False, 1.0)
    assert tr.launches == 1
    assert 20 * n <= tr.bytes_requested <= 1.01 * 20 * n, tr.bytes_requested / n
