"""amp's gradient unscale + overflow check over 1,000 gradients, against torch.amp.GradScaler.unscale_.

Per case: apex's ``LossScaler.unscale`` + ``update_scale`` (one fused check, one host sync) against
PyTorch's ``GradScaler.unscale_`` + ``update`` on the same gradients. O1 unscales fp32 grads in place;
O2 reads bf16 model grads and writes fp32 master grads (GradScaler cannot do that in one call, so its
side is a foreach copy followed by ``unscale_``).
"""

import torch

from apex.amp.scaler import LossScaler
from benchmarks._harness import Case, Counted
from benchmarks.ops._lists import mixed_sizes, nbytes


def _params(grads):
    params = [torch.nn.Parameter(torch.zeros_like(g, dtype=torch.float32)) for g in grads]
    return params


def _torch_side(grads_fp32, model_grads=None):
    params = _params(grads_fp32)
    for p, g in zip(params, grads_fp32):
        p.grad = g
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2000)
    scaler.scale(torch.ones(()))  # materialise the scale tensor

    def run():
        if model_grads is not None:
            torch._foreach_copy_(grads_fp32, model_grads)
        scaler.unscale_(opt)
        scaler.update()

    return run


def _ours(model_grads, master_grads, in_place):
    scaler = LossScaler("dynamic")

    def run():
        scaler.clear_overflow_state()
        scaler.unscale(model_grads, master_grads, None, models_are_masters=in_place)
        scaler.update_scale()

    return run


def _o1(n_tensors, max_size, seed=0):
    grads = mixed_sizes(n_tensors, max_size, seed=seed)
    mine = [g.clone() for g in grads]
    return _ours(mine, mine, True), _torch_side(grads)


def _o2(n_tensors, max_size, seed=0):
    model = mixed_sizes(n_tensors, max_size, seed=seed, dtype=torch.bfloat16)
    masters = [torch.empty_like(g, dtype=torch.float32) for g in model]
    theirs = [torch.empty_like(g, dtype=torch.float32) for g in model]
    return _ours(model, masters, False), _torch_side(theirs, model)


def _counted_o1():
    ours, theirs = _o1(1000, 200, seed=1)
    grads = mixed_sizes(1000, 200, seed=1)
    return Counted(triton=ours, eager=theirs, bytes_min=2 * nbytes(grads),
                   note="fp32 grads unscaled in place: each read once and written once")


def _counted_o2():
    ours, theirs = _o2(1000, 200, seed=1)
    model = mixed_sizes(1000, 200, seed=1, dtype=torch.bfloat16)
    return Counted(triton=ours, eager=theirs, bytes_min=nbytes(model) * 3,
                   note="bf16 model grads read once, fp32 master grads written once")


def cases():
    return [
        Case("amp unscale O1 1000 fp32 grads", timed=lambda: _o1(1000, 20000), counted=_counted_o1,
             torch_label="GradScaler.unscale_+update"),
        Case("amp unscale O2 1000 bf16->fp32 grads", timed=lambda: _o2(1000, 20000), counted=_counted_o2,
             torch_label="foreach_copy+GradScaler.unscale_"),
    ]
