"""``FusedAdamSWA.step`` (Adam + bf16 copy + SWA average) against the PyTorch composition a user writes:
``torch.optim.Adam`` (foreach), ``torch._foreach_copy_`` into the bf16 copies, ``torch._foreach_lerp_`` for
the average. Gradients live on the bf16 copies, so the composition first copies them to the fp32 params.

Minimum bytes per element (fp32 state, bf16 compute copy): read g (2), p, m, v, swa (16); write p, m, v,
swa (16) and the bf16 copy (2): 36 B.
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted
from benchmarks.ops._lists import mixed_sizes


def _setup(n_tensors, max_size, seed=0):
    from apex.contrib.openfold_triton.fused_adam_swa import FusedAdamSWA

    params = [torch.nn.Parameter(t) for t in mixed_sizes(n_tensors, max_size, seed)]
    compute = [p.detach().to(torch.bfloat16) for p in params]
    for c in compute:
        c.grad = torch.randn(c.shape).to(torch.bfloat16)
    swa = [p.detach().clone() for p in params]
    opt = FusedAdamSWA(params, compute, swa, swa_decay_rate=0.99, lr=1e-3, weight_decay=1e-2)
    opt.swa_param_groups[0]["n_averaged"] = 1  # steady state: the average reads its old value

    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    compute2 = [c.detach().clone() for c in compute]
    grads2 = [c.grad.clone() for c in compute]
    swa2 = [s.clone() for s in swa]
    adam = torch.optim.Adam(twins, lr=1e-3, weight_decay=1e-2, foreach=True)

    def composition():
        for t, g in zip(twins, grads2):
            t.grad = g.float()
        adam.step()
        with torch.no_grad():
            torch._foreach_copy_(compute2, twins)
            torch._foreach_lerp_(swa2, twins, 0.01)

    elements = sum(p.numel() for p in params)
    return opt, composition, elements


def _timed():
    opt, comp, n = _setup(200, 50000)
    return opt.step, comp, {"elements": n}


def _counted():
    opt, comp, n = _setup(40, 4000, seed=1)
    return Counted(triton=opt.step, eager=comp, bytes_min=36 * n, note=f"{n} elements in 40 tensors")


def cases() -> list[Case]:
    return [Case("openfold_fused_adam_swa 200 fp32+bf16", timed=_timed, counted=_counted,
                 torch_label="Adam(foreach)+copy+lerp")]
