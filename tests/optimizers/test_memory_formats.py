"""A channels_last convolution weight (gradient in either layout) is optimized exactly like its contiguous
twin: same parameters and the same state, element for element, read through the tensors' own strides."""

import pytest
import torch

import apex.optimizers as O
from apex.testing import assert_rel_close

OPTIMIZERS = {
    "FusedAdam": (O.FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
    "FusedSGD": (O.FusedSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "FusedAdagrad": (O.FusedAdagrad, dict(lr=0.1)),
    "FusedLAMB": (O.FusedLAMB, dict(lr=1e-2)),
    "FusedNovoGrad": (O.FusedNovoGrad, dict(lr=1e-2, weight_decay=0.01)),
    "FusedMixedPrecisionLamb": (O.FusedMixedPrecisionLamb, dict(lr=1e-2)),
    "FusedLARS": (O.FusedLARS, dict(lr=0.1, momentum=0.9, weight_decay=1e-4)),
}


def _run(name, layout, grad_layout):
    cls, kw = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3, 5, 6, generator=gen).to(memory_format=layout))
    bias = torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = cls([weight, bias], **kw)
    for _ in range(3):
        gw = torch.randn(4, 3, 5, 6, generator=gen)
        weight.grad = gw.to(memory_format=grad_layout)
        bias.grad = torch.randn(4, generator=gen)
        opt.step()
    state = {k: v for k, v in opt.state[weight].items() if torch.is_tensor(v) and v.dim() > 0}
    return weight.detach(), state


@pytest.mark.parametrize("grad_layout", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_channels_last_weight_matches_contiguous(name, grad_layout):
    ref_w, ref_state = _run(name, torch.contiguous_format, torch.contiguous_format)
    w, state = _run(name, torch.channels_last, grad_layout)
    assert w.is_contiguous(memory_format=torch.channels_last)
    assert_rel_close(w, ref_w, tol=1e-6)
    assert state.keys() == ref_state.keys() and state
    for key in state:
        assert_rel_close(state[key], ref_state[key], tol=1e-6)
