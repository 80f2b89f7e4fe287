"""multi_tensor_l2norm (total and per-tensor norms) over 1,000 tensors."""

import amp_C
import torch

from benchmarks._harness import Case, Counted
from benchmarks.ops._lists import mixed_sizes, nbytes


def _eager(xs):
    per = torch.stack(torch._foreach_norm(xs, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(per), per


def _timed(dtype):
    def build():
        xs = mixed_sizes(1000, 20000, dtype=dtype)
        noop = torch.zeros(1, dtype=torch.int32)
        return lambda: amp_C.multi_tensor_l2norm(2048 * 32, noop, [xs], True), lambda: _eager(xs)
    return build


def _counted(dtype):
    def build():
        xs = mixed_sizes(1000, 2000, seed=1, dtype=dtype)
        noop = torch.zeros(1, dtype=torch.int32)
        return Counted(triton=lambda: amp_C.multi_tensor_l2norm(2048 * 32, noop, [xs], True),
                       eager=lambda: _eager(xs), bytes_min=nbytes(xs),
                       note="plus 4 bytes per chunk partial and per-tensor output")
    return build


def cases():
    return [Case(f"multi_tensor_l2norm 1000 {name}", timed=_timed(dt), counted=_counted(dt),
                 torch_label="foreach_norm")
            for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16))]
