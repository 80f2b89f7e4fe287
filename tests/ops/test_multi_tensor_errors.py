"""Wrong input to the amp_C ops is rejected with an error naming what was wrong, and changes nothing."""

import amp_C
import pytest
import torch

from tests.ops._lists import flag

OPS = {
    "scale": (lambda noop, lists: amp_C.multi_tensor_scale(2048, noop, lists, 2.0), 2),
    "axpby": (lambda noop, lists: amp_C.multi_tensor_axpby(2048, noop, lists, 1.0, 1.0, -1), 3),
    "l2norm": (lambda noop, lists: amp_C.multi_tensor_l2norm(2048, noop, lists, True), 1),
}


def _lists(n, make):
    return [[make(i, j) for j in range(3)] for i in range(n)]


@pytest.mark.parametrize("op", OPS)
def test_unequal_list_lengths(op, backend_name):
    fn, n = OPS[op]
    if n == 1:
        pytest.skip("single list")
    lists = _lists(n, lambda i, j: torch.ones(4))
    lists[-1].pop()
    with pytest.raises(ValueError, match="same length"):
        fn(flag(), lists)


@pytest.mark.parametrize("op", OPS)
def test_wrong_number_of_lists(op):
    fn, n = OPS[op]
    with pytest.raises(ValueError, match="lists"):
        fn(flag(), _lists(n + 1, lambda i, j: torch.ones(4)))


@pytest.mark.parametrize("op", OPS)
def test_different_devices(op):
    fn, n = OPS[op]
    lists = _lists(n, lambda i, j: torch.ones(4))
    lists[0][1] = torch.ones(4, device="meta")
    with pytest.raises(ValueError, match="device"):
        fn(flag(), lists)


@pytest.mark.parametrize("op", OPS)
def test_non_contiguous(op):
    fn, n = OPS[op]
    lists = _lists(n, lambda i, j: torch.ones(4, 4))
    lists[0][2] = torch.ones(4, 4).t()
    before = [t.clone() for lst in lists for t in lst]
    with pytest.raises(ValueError, match="contiguous"):
        fn(flag(), lists)
    assert all(torch.equal(a, b) for a, b in zip([t for lst in lists for t in lst], before))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64, torch.bool])
def test_unsupported_dtype(op, dtype):
    fn, n = OPS[op]
    lists = _lists(n, lambda i, j: torch.ones(4))
    lists[0][0] = torch.ones(4, dtype=dtype)
    with pytest.raises(TypeError, match="dtype"):
        fn(flag(), lists)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("noop", [torch.zeros(1), torch.zeros(2, dtype=torch.int32), 0])
def test_bad_noop_flag(op, noop):
    fn, n = OPS[op]
    with pytest.raises((TypeError, ValueError), match="noop_flag"):
        fn(noop, _lists(n, lambda i, j: torch.ones(4)))


def test_size_mismatch_between_lists():
    with pytest.raises(ValueError, match="shape"):
        amp_C.multi_tensor_scale(2048, flag(), [[torch.ones(4)], [torch.ones(5)]], 1.0)


def test_not_a_list():
    with pytest.raises(TypeError, match="list of lists"):
        amp_C.multi_tensor_scale(2048, flag(), torch.ones(3), 1.0)


def test_unknown_amp_c_name():
    with pytest.raises(AttributeError, match="amp_C"):
        amp_C.multi_tensor_does_not_exist  # noqa: B018


@pytest.mark.parametrize("op", OPS)
def test_a_repeated_call_checks_what_changed_at_the_same_addresses(op):
    # A call whose tensors have the addresses and metadata of an earlier call that passed the checks skips
    # them (apex._kernels._lists.checked): a tensor of another layout or dtype at one of those addresses must
    # be refused all the same.
    fn, n = OPS[op]
    bufs = _lists(n, lambda i, j: torch.ones(4, 4))
    for _ in range(2):  # (the second call skips the checks)
        fn(flag(), [list(lst) for lst in bufs])
    lists = [list(lst) for lst in bufs]
    lists[0][2] = bufs[0][2].t()
    with pytest.raises(ValueError, match="contiguous"):
        fn(flag(), lists)
    lists = [list(lst) for lst in bufs]
    lists[0][0] = bufs[0][0].view(torch.int32)
    with pytest.raises(TypeError, match="dtype"):
        fn(flag(), lists)
