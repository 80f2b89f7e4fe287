"""The amp_C ops write their tensors' data as Apex's kernels do: parameters that require grad may be passed
outside ``torch.no_grad()`` (on both paths), they are updated in place, and nothing joins the autograd
graph."""

import amp_C
import pytest
import torch

from tests.ops._lists import flag


def _param(seed):
    return torch.nn.Parameter(torch.randn(37, generator=torch.Generator().manual_seed(seed)))


def _t(seed, positive=False):
    x = torch.randn(37, generator=torch.Generator().manual_seed(seed))
    return x.abs() + 0.1 if positive else x


# name: (call on [lists], index of the list holding the parameter)
OPS = {
    "scale": (lambda n, p: amp_C.multi_tensor_scale(2048, n, [[_t(1)], [p]], 0.5), 1),
    "axpby": (lambda n, p: amp_C.multi_tensor_axpby(2048, n, [[_t(1)], [_t(2)], [p]], 1.0, 2.0, -1), 2),
    "l2norm_scale": (lambda n, p: amp_C.multi_tensor_l2norm_scale(2048, n, [[_t(1)], [p]], 0.5, False), 1),
    "adam": (lambda n, p: amp_C.multi_tensor_adam(2048, n, [[_t(1)], [p], [_t(2)], [_t(3, True)]], 1e-2, 0.9,
                                                  0.999, 1e-8, 2, 1, 1, 0.01), 1),
    "sgd": (lambda n, p: amp_C.multi_tensor_sgd(2048, n, [[_t(1)], [p], [_t(2)]], 0.01, 0.9, 0.0, 0.1, False,
                                                False, False, 1.0), 1),
    "adagrad": (lambda n, p: amp_C.multi_tensor_adagrad(2048, n, [[_t(1)], [p], [_t(2, True)]], 1e-2, 1e-10, 0,
                                                        0.01), 1),
    "lamb": (lambda n, p: amp_C.multi_tensor_lamb(2048, n, [[_t(1)], [p], [_t(2)], [_t(3, True)]], 1e-2, 0.9,
                                                  0.999, 1e-6, 2, 1, 0.01, 1, 1, torch.tensor([2.0]), 1.0,
                                                  False), 1),
    "novograd": (lambda n, p: amp_C.multi_tensor_novograd(2048, n, [[_t(1)], [p], [_t(2)]], torch.ones(1),
                                                          1e-2, 0.9, 0.999, 1e-8, 2, 1, 0.01, 1, 1, 2), 1),
    "lars": (lambda n, p: amp_C.multi_tensor_lars(2048, n, [[_t(1)], [p], [_t(2)]], torch.ones(1),
                                                  torch.ones(1), 0.1, 0.001, 0.0, 0.0, 0.9, 0.0, False, False,
                                                  False, 1.0, False), 1),
}


@pytest.mark.parametrize("op", OPS)
def test_parameters_that_require_grad_are_updated_outside_no_grad(op, backend_name):
    fn, _ = OPS[op]
    p = _param(0)
    before = p.detach().clone()
    assert torch.is_grad_enabled()
    fn(flag(), p)
    assert p.is_leaf and p.requires_grad and p.grad_fn is None
    assert not torch.equal(p.detach(), before)
    # The same update as on a plain tensor.
    q = _param(0).detach()
    fn(flag(), q)
    assert torch.equal(p.detach(), q)
