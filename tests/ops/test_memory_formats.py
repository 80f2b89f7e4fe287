"""channels_last tensors, which Apex's ``multi_tensor_apply`` accepts beside contiguous ones: every amp_C op
gives them the same values as their contiguous twins, on both paths; a list whose layout differs from list
0's at the same index is refused before anything changes."""

import amp_C
import pytest
import torch

from apex.testing import assert_rel_close
from tests.ops._lists import flag

SHAPES = [(2, 3, 5, 7), (4, 1, 3, 3), (3, 2, 1, 9)]


def _lists(n_lists, seed, positive=()):
    g = torch.Generator().manual_seed(seed)
    out = []
    for li in range(n_lists):
        lst = [torch.randn(*s, generator=g) for s in SHAPES]
        out.append([t.abs() + 0.1 for t in lst] if li in positive else lst)
    return out


def _lamb(noop, lists):
    amp_C.multi_tensor_lamb(2048, noop, lists, 1e-2, 0.9, 0.999, 1e-6, 3, 1, 0.01, 1, 1,
                            torch.tensor([0.5]), 1.0, False)


def _novograd(noop, lists):
    amp_C.multi_tensor_novograd(2048, noop, lists, torch.ones(len(SHAPES)), 1e-2, 0.95, 0.98, 1e-8, 3, 1,
                                0.01, 1, 1, 2)


# name: (call, number of lists, lists holding positive values (second moments))
OPS = {
    "scale": (lambda noop, lists: amp_C.multi_tensor_scale(2048, noop, lists, 0.5), 2, ()),
    "axpby": (lambda noop, lists: amp_C.multi_tensor_axpby(2048, noop, lists, 2.0, -1.0, -1), 3, ()),
    "l2norm": (lambda noop, lists: amp_C.multi_tensor_l2norm(2048, noop, lists, True)[1], 1, ()),
    "adam": (lambda noop, lists: amp_C.multi_tensor_adam(2048, noop, lists, 1e-2, 0.9, 0.999, 1e-8, 3, 1, 1,
                                                         0.01), 4, (3,)),
    "sgd": (lambda noop, lists: amp_C.multi_tensor_sgd(2048, noop, lists, 0.01, 0.9, 0.0, 0.1, False, False,
                                                       False, 1.0), 3, ()),
    "adagrad": (lambda noop, lists: amp_C.multi_tensor_adagrad(2048, noop, lists, 1e-2, 1e-10, 1, 0.01), 3,
                (2,)),
    "lamb": (_lamb, 4, (3,)),
    "novograd": (_novograd, 3, ()),
}


@pytest.mark.parametrize("op", OPS)
def test_channels_last_gives_the_contiguous_values(op, backend_name):
    fn, n, positive = OPS[op]
    plain = _lists(n, seed=1, positive=positive)
    cl = [[t.to(memory_format=torch.channels_last) for t in lst] for lst in plain]
    assert not cl[0][0].is_contiguous()
    out_plain, out_cl = fn(flag(), plain), fn(flag(), cl)
    for a, b in zip([t for lst in plain for t in lst], [t for lst in cl for t in lst]):
        assert b.is_contiguous(memory_format=torch.channels_last)  # updated in place, layout kept
        assert_rel_close(b, a, tol=1e-6)
    if out_plain is not None:
        assert_rel_close(out_cl, out_plain, tol=1e-6)


@pytest.mark.parametrize("op", [op for op, (_, n, _) in OPS.items() if n > 1])
def test_a_layout_unlike_list_zero_is_refused(op):
    fn, n, positive = OPS[op]
    lists = _lists(n, seed=2, positive=positive)
    lists[0] = [t.to(memory_format=torch.channels_last) for t in lists[0]]
    before = [t.clone() for lst in lists for t in lst]
    with pytest.raises(ValueError, match=r"memory layout of tensor_lists\[0\]\[0\]"):
        fn(flag(), lists)
    assert all(torch.equal(a, b) for a, b in zip([t for lst in lists for t in lst], before))
