"""O1's casting stays out of backward, and the dynamic loss scale starts under ``max_loss_scale``."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from apex import amp

MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear"}


class MatmulDtypes(TorchDispatchMode):
    """Records the input dtypes of every matmul dispatched while active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in MATMULS:
            self.seen.append((func.__name__, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        return func(*args, **(kwargs or {}))


def _nets(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.GELU(), torch.nn.Linear(40, 24))


def _fp32_grads(net, x, loss_fn):
    net.zero_grad()
    loss_fn(net(x)).backward()
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("how", ["float_function", "disable_casts", "outside_model"])
def test_fp32_region_gets_fp32_gradients_bit_for_bit(half, how):
    amp_model, fp32_region = _nets(1), _nets(2)
    x = torch.randn(7, 24)
    loss_fn = lambda y: (y.float() ** 2).mean()  # noqa: E731
    expected = _fp32_grads(fp32_region, x, loss_fn)
    fp32_region.zero_grad(set_to_none=True)

    params = list(amp_model.parameters()) + list(fp32_region.parameters())
    opt = torch.optim.SGD(params, lr=0.0)
    amp_model, opt = amp.initialize(amp_model, opt, opt_level="O1", half_dtype=half, verbosity=0,
                                    loss_scale=1.0)
    h = amp_model(x)  # half-precision region
    assert h.dtype == half
    if how == "float_function":
        y = amp.float_function(fp32_region)(x)
    elif how == "disable_casts":
        with amp.disable_casts():
            y = fp32_region(x)
    else:  # a module run under O1: torch.autocast would cast it, unless the user switched it off
        with torch.autocast("cpu", enabled=False):
            y = fp32_region(x)
    assert y.dtype == torch.float32
    loss = loss_fn(y) + loss_fn(h) * 0.0
    rec = MatmulDtypes()
    with rec, amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    got = [p.grad for p in fp32_region.parameters()]
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32 and torch.equal(g, e)
    # Backward's matmuls: fp32 for the fp32 region, the half type for amp's region; none cast back and forth.
    dtypes = {d for _, ds in rec.seen for d in ds}
    assert torch.float32 in dtypes and half in dtypes
    assert all(len(set(ds)) == 1 for _, ds in rec.seen), rec.seen
    # The casting is back on after the block.
    assert torch.is_autocast_enabled("cpu")


def test_half_region_backward_stays_half_with_dynamic_scale():
    model = _nets(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    loss = model(torch.randn(5, 24)).float().pow(2).mean()
    rec = MatmulDtypes()
    with rec, amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    assert rec.seen and all(set(ds) == {torch.bfloat16} for _, ds in rec.seen), rec.seen
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("max_scale,start", [(1024.0, 1024.0), (2.0 ** 24, 2.0 ** 16), (2.0 ** 16, 2.0 ** 16)])
def test_dynamic_scale_starts_at_most_at_max_loss_scale(max_scale, start):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O1", verbosity=0, max_loss_scale=max_scale, num_losses=2)
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [start, start]
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == start


def test_static_scale_ignores_max_loss_scale():
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0, loss_scale=4096.0, max_loss_scale=1024.0)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 4096.0
