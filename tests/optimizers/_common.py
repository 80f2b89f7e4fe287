"""Helpers shared by the optimizer tests: ragged parameter sets and a step-by-step driver."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch

# Ragged sizes (not multiples of any block) plus a 3-D tensor. The Triton path runs under the
# interpreter, which is slow per program, so it gets the same shapes minus the largest one.
SHAPES_TORCH = [(1,), (3,), (4097,), (65537,), (5, 7, 3)]
SHAPES_TRITON = [(1,), (3,), (4097,), (5, 7, 3)]
# (dtype, tolerance of the relative error against the float64 reference) for the element-wise optimizers.
PRECISIONS = [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)]


def shapes_for(backend: str) -> list[tuple[int, ...]]:
    return SHAPES_TORCH if backend == "torch" else SHAPES_TRITON


def make_params(shapes, dtype=torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in shapes]


def clone_params(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def grads_for_step(params, step: int, seed: int = 1, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype) for p in params]


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def set_grad_of_another_dtype(p: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """``p.grad = grad`` where ``grad``'s dtype differs from ``p``'s, as a client's code can leave it: PyTorch's
    setter refuses that unless ``p.grad_dtype`` is None (torch 2.9 and newer); before, through ``.data``."""
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None
        p.grad = grad
    else:
        p.grad = torch.zeros_like(p)
        p.grad.data = grad


def snapshot(opt: torch.optim.Optimizer, params) -> tuple[list[torch.Tensor], dict]:
    return [p.detach().clone() for p in params], copy.deepcopy(opt.state_dict())


def assert_state_equal(a: dict, b: dict) -> None:
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        sa, sb = a["state"][k], b["state"][k]
        assert sa.keys() == sb.keys(), (sa.keys(), sb.keys())
        for key in sa:
            va, vb = sa[key], sb[key]
            if isinstance(va, torch.Tensor):
                assert torch.equal(va.cpu(), vb.cpu()), (k, key)
            else:
                assert va == vb, (k, key)


def check_grad_scaler_skips_then_resumes(make_opt, device: torch.device) -> None:
    """A ``torch.amp.GradScaler`` step of bf16 parameters on ``device`` that finds an inf changes neither the
    parameters nor the optimizer's state and lowers the scale; the next finite step equals an unscaled step
    of a twin optimizer. Runs under the caller's backend."""
    params = make_params([(33,), (4097,), (3, 5)], torch.bfloat16)
    opt = make_opt(params)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 8)
    scaler.scale(torch.ones((), device=device))  # initialises the scale, as scaling a loss does
    for s in range(2):
        set_grads(params, grads_for_step(params, s, scale=2.0 ** 8))
        scaler.step(opt)
        scaler.update()
    before = [p.detach().clone() for p in params]
    state = copy.deepcopy(opt.state_dict())
    scale = scaler.get_scale()
    set_grads(params, grads_for_step(params, 5, scale=scale))
    params[2].grad[1, 1] = float("inf")
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() < scale  # the scaler saw the inf (found_inf recorded for update())
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert_state_equal(opt.state_dict(), state)
    twins = clone_params(params)
    ref = make_opt(twins)
    ref.load_state_dict(copy.deepcopy(opt.state_dict()))
    scale = scaler.get_scale()
    for p, t, g in zip(params, twins, grads_for_step(params, 6)):
        p.grad = (g.float() * scale).to(p.dtype)
        t.grad = g.clone()
    scaler.step(opt)
    ref.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twins))


@contextlib.contextmanager
def counting_tables() -> Iterator[list]:
    """Within the block, each device table the multi-tensor engine builds (``TensorTable``) appends to the
    yielded list: a step given new gradient tensors should upload one table per launch group, not one per
    launch."""
    from apex._kernels import _mt_tables as tables  # (where tables are made: table, with_first_list)

    built: list = []
    real = tables.TensorTable

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    tables.TensorTable = counting
    try:
        yield built
    finally:
        tables.TensorTable = real


# One of each fused optimizer (and FusedAdam's capturable master-weight form), with weight decay where it has
# one: the tests that make one change between steps, or one layout, and compare (plans and tables reused).
def _fused_optimizers() -> dict:
    from apex.optimizers import (
        FusedAdagrad,
        FusedAdam,
        FusedLAMB,
        FusedLARS,
        FusedMixedPrecisionLamb,
        FusedNovoGrad,
        FusedSGD,
    )

    return {
        "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
        "FusedAdam-capturable-master": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, capturable=True,
                                                            master_weights=True),
        "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
        "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.01),
        "FusedLARS": lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
        "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
        "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2, weight_decay=0.01),
        "FusedMixedPrecisionLamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, weight_decay=0.01,
                                                                     reduced_precision_dtype=torch.bfloat16),
    }


FUSED_OPTIMIZERS = _fused_optimizers()
