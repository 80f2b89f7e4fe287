import pytest
import torch

from apex.contrib.clip_grad import clip_grad_norm_
from apex.testing import TritonTrace, assert_rel_close


def _params(dtypes, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    ps = []
    for i, dt in enumerate(dtypes):
        p = torch.nn.Parameter(torch.randn(3 + 700 * i, generator=g).to(dt))
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(dt)
        ps.append(p)
    return ps


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("dtypes", [(torch.float32,) * 3, (torch.float32, torch.float16, torch.bfloat16)])
def test_matches_torch(backend_name, max_norm, dtypes):
    ours, theirs = _params(dtypes), _params(dtypes)
    with TritonTrace(bounds=True) as tr:
        tr.watch([p.grad for p in ours])
        total = clip_grad_norm_(ours, max_norm)
    if backend_name == "triton":
        assert tr.launches == len(set(dtypes)) * 2 + 1  # norm partials + finalize + scale per group
    ref = torch.cat([p.grad.double().reshape(-1) for p in theirs]).norm()
    coef = min(1.0, max_norm / (ref.item() + 1e-6))
    torch.nn.utils.clip_grad_norm_(theirs, max_norm)  # PyTorch in the gradients' dtypes: the baseline
    assert total.shape == () and total.dtype == torch.float32
    assert_rel_close(total, ref, tol=1e-5)
    for a, b, c in zip(ours, theirs, _params(dtypes)):
        assert_rel_close(a.grad, c.grad.double() * coef, baseline=b.grad)
    if max_norm < 1:
        flat = torch.cat([p.grad.double().reshape(-1) for p in ours])
        assert flat.norm().item() == pytest.approx(max_norm, rel=1e-2)


def test_non_finite(backend_name):
    ps = _params((torch.float32, torch.float32))
    ps[1].grad[5] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(ps, 1.0, error_if_nonfinite=True)
    total = clip_grad_norm_(ps, 1.0)
    assert not torch.isfinite(total)


def test_other_norms_and_edge_cases(backend_name):
    ours, theirs = _params((torch.float32,) * 2), _params((torch.float32,) * 2)
    total = clip_grad_norm_(ours, 0.1, norm_type="inf")
    assert_rel_close(total, torch.nn.utils.clip_grad_norm_(theirs, 0.1, norm_type="inf").double())
    assert clip_grad_norm_([torch.nn.Parameter(torch.ones(2))], 1.0).item() == 0.0
    single = _params((torch.float32,))[0]
    assert clip_grad_norm_(single, 1e9).item() > 0
    with pytest.raises(TypeError, match="max_norm"):
        clip_grad_norm_(ours, "1.0")
