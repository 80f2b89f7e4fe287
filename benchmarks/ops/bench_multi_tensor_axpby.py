"""multi_tensor_axpby (out = a*x + b*y + inf/NaN check) over 1,000 tensors."""

import amp_C
import torch

from benchmarks._harness import Case, Counted
from benchmarks.ops._lists import mixed_sizes, nbytes


def _eager(xs, ys, outs):
    torch._foreach_copy_(outs, torch._foreach_add(torch._foreach_mul(xs, 2.0), ys, alpha=-0.5))
    return torch.stack(torch._foreach_norm(xs + ys, float("inf"))).isfinite().all()


def _lists(n, size, seed):
    xs, ys = mixed_sizes(n, size, seed), mixed_sizes(n, size, seed)
    return xs, ys, [torch.empty_like(x) for x in xs]


def _timed():
    xs, ys, outs = _lists(1000, 20000, 0)
    noop = torch.zeros(1, dtype=torch.int32)
    return (lambda: amp_C.multi_tensor_axpby(2048 * 32, noop, [xs, ys, outs], 2.0, -0.5, -1),
            lambda: _eager(xs, ys, outs))


def _counted():
    xs, ys, outs = _lists(300, 2000, 1)
    noop = torch.zeros(1, dtype=torch.int32)
    return Counted(triton=lambda: amp_C.multi_tensor_axpby(2048 * 32, noop, [xs, ys, outs], 2.0, -0.5, -1),
                   eager=lambda: _eager(xs, ys, outs), bytes_min=nbytes(xs) + nbytes(ys) + nbytes(outs))


def cases():
    return [Case("multi_tensor_axpby 1000 fp32", timed=_timed, counted=_counted, torch_label="foreach")]
