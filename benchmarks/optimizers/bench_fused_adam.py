"""FusedAdam step against torch.optim.AdamW (fused, foreach, for-loop)."""

import torch

from apex.optimizers import FusedAdam
from benchmarks.optimizers._common import make_cases


def cases():
    return make_cases(
        "FusedAdam", lambda ps: FusedAdam(ps, lr=1e-3, weight_decay=0.01),
        {"AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True),
         "AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=True),
         "AdamW for-loop": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, foreach=False)},
        per_param_rw=28)


def gpu_cases():
    from benchmarks.optimizers._gpu_adam import gpu_cases

    return gpu_cases()
