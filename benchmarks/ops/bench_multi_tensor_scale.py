"""multi_tensor_scale (out = in * scale + inf/NaN check) over 1,000 tensors."""

import amp_C
import torch

from benchmarks._harness import Case, Counted
from benchmarks.ops._lists import mixed_sizes, nbytes


def _eager(ins, outs, scale):
    # What a PyTorch user writes: scale, then a non-finite check that stays on the device.
    torch._foreach_copy_(outs, torch._foreach_mul(ins, scale))
    return torch.stack(torch._foreach_norm(ins, float("inf"))).isfinite().all()


def _timed():
    ins = mixed_sizes(1000, 20000)
    outs = [torch.empty_like(x) for x in ins]
    noop = torch.zeros(1, dtype=torch.int32)
    return (lambda: amp_C.multi_tensor_scale(2048 * 32, noop, [ins, outs], 0.5),
            lambda: _eager(ins, outs, 0.5))


def _counted():
    ins = mixed_sizes(1000, 2000, seed=1)
    outs = [torch.empty_like(x) for x in ins]
    noop = torch.zeros(1, dtype=torch.int32)
    return Counted(triton=lambda: amp_C.multi_tensor_scale(2048 * 32, noop, [ins, outs], 0.5),
                   eager=lambda: _eager(ins, outs, 0.5), bytes_min=nbytes(ins) + nbytes(outs))


def cases():
    return [Case("multi_tensor_scale 1000 fp32", timed=_timed, counted=_counted,
                 torch_label="foreach_mul+norm")]
