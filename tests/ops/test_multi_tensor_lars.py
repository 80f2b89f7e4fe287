"""amp_C.multi_tensor_lars against float64: trust ratios per tensor, is_skipped, noop, one launch."""

import amp_C
import pytest
import torch

from apex.testing import TritonTrace, assert_rel_close
from tests.ops._lists import flag, ragged

SIZES = (1, 7, 4097, 65537)


def _ref(g, w, b, gn, pn, *, lr, tc, eps, wd, momentum, first_run, skipped, scale=1.0):
    g, w, b = g.double(), w.double(), b.double()
    ratio = tc * pn / (gn + pn * wd + eps) if (gn > 0 and pn > 0 and not skipped) else 1.0
    lr_i = lr * ratio
    g = g * scale + wd * w
    if momentum:
        b = -lr_i * g if first_run else momentum * b - lr_i * g
        return w + b, b
    return w - lr_i * g, b


@pytest.mark.parametrize("momentum,first_run,skipped,scale", [(0.9, False, False, 1.0), (0.9, True, False, 1.0),
                                                              (0.0, False, False, 0.25), (0.9, False, True, 1.0),
                                                              (0.9, False, False, 0.25)])
def test_lars_matches_float64(backend_name, momentum, first_run, skipped, scale):
    g, w, b = (ragged(torch.float32, SIZES, s) for s in range(3))
    gn = torch.stack([x.norm() for x in g])
    pn = torch.stack([x.norm() for x in w])
    pn[0] = 0.0  # a zero norm falls back to the plain learning rate
    refs = [_ref(*t, float(a), float(c), lr=0.5, tc=0.01, eps=1e-8, wd=1e-3, momentum=momentum,
                 first_run=first_run, skipped=skipped, scale=scale) for t, a, c in zip(zip(g, w, b), gn, pn)]
    args = (gn, pn, 0.5, 0.01, 1e-8, 1e-3, momentum, 0.0, False, first_run, False, scale, skipped)
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(g, w, b)
            amp_C.multi_tensor_lars(2048, flag(), [g, w, b], *args)
        assert tr.launches == 1
    else:
        amp_C.multi_tensor_lars(2048, flag(), [g, w, b], *args)
    for x, bb, (rw, rb) in zip(w, b, refs):
        assert_rel_close(x, rw, torch.float32)
        if momentum:
            assert_rel_close(bb, rb, torch.float32)


def test_noop_flag_skips(backend_name):
    g, w, b = (ragged(torch.float32, SIZES, s) for s in range(3))
    before = [x.clone() for x in w]
    norms = torch.ones(len(SIZES))
    amp_C.multi_tensor_lars(2048, torch.ones(1, dtype=torch.int32), [g, w, b], norms, norms, 0.5, 0.01, 0.0,
                            0.0, 0.9, 0.0, False, False, False, 1.0, False)
    assert all(torch.equal(x, y) for x, y in zip(w, before))


def test_norms_must_cover_every_tensor():
    g, w, b = (ragged(torch.float32, SIZES, s) for s in range(3))
    with pytest.raises(ValueError, match="grad_norms"):
        amp_C.multi_tensor_lars(2048, flag(), [g, w, b], torch.ones(2), torch.ones(4), 0.5, 0.01, 0.0, 0.0,
                                0.9, 0.0, False, False, False, 1.0, False)
