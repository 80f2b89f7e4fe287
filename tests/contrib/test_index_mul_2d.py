"""apex.contrib.index_mul_2d: Apex's API, including the energy/force double backward of Apex's test."""

import pytest
import torch

from apex.testing import assert_rel_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_index_mul_2d_energy_force(backend_name, dtype):
    from apex.contrib.index_mul_2d import index_mul_2d
    from apex.contrib.index_mul_2d.index_mul_2d import index_mul_2d_backward

    torch.manual_seed(1)
    in1 = torch.randn(17, 40).to(dtype)
    in2 = torch.randn(300, 40).to(dtype)
    idx = torch.randint(0, 17, (300,))
    results = []
    for fn, cast in ((index_mul_2d, lambda t: t), (lambda a, b, i: a[i] * b, lambda t: t.double())):
        a = cast(in1).clone().requires_grad_()
        b = cast(in2).clone().requires_grad_()
        out = fn(a, b, idx)
        energy = (out.float() ** 2).sum() / out.numel()
        (force,) = torch.autograd.grad(energy, a, create_graph=True)
        loss = (out.float() ** 2).sum() / out.numel() + (force.float() ** 2).sum()
        loss.backward()
        results.append([out, a.grad, b.grad])
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert_rel_close(results[0], results[1], tol=tol)
    g = torch.randn(300, 40).to(dtype)
    g1, g2 = index_mul_2d_backward(in1, in2, idx, g)
    assert_rel_close(g2, in1.double()[idx] * g.double(), tol=tol)


def test_compat_module_names():
    import fused_index_mul_2d

    assert "float_forward" in fused_index_mul_2d.__all__ and "half_backward_backward" in fused_index_mul_2d.__all__
