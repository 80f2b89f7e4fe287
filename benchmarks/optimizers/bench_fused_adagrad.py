"""FusedAdagrad step against torch.optim.Adagrad (fused, foreach, for-loop)."""

import torch

from apex.optimizers import FusedAdagrad
from benchmarks.optimizers._common import make_cases


def cases():
    kw = dict(lr=1e-2, weight_decay=1e-4)
    return make_cases(
        "FusedAdagrad", lambda ps: FusedAdagrad(ps, **kw),
        {"Adagrad fused": lambda ps: torch.optim.Adagrad(ps, **kw, fused=True),
         "Adagrad foreach": lambda ps: torch.optim.Adagrad(ps, **kw, foreach=True),
         "Adagrad for-loop": lambda ps: torch.optim.Adagrad(ps, **kw, foreach=False)}, per_param_rw=20)
