"""FusedSGD (momentum 0.9) step against torch.optim.SGD (fused, foreach, for-loop)."""

import torch

from apex.optimizers import FusedSGD
from benchmarks.optimizers._common import make_cases


def cases():
    kw = dict(lr=0.1, momentum=0.9, weight_decay=1e-4)
    return make_cases(
        "FusedSGD", lambda ps: FusedSGD(ps, **kw),
        {"SGD fused": lambda ps: torch.optim.SGD(ps, **kw, fused=True),
         "SGD foreach": lambda ps: torch.optim.SGD(ps, **kw, foreach=True),
         "SGD for-loop": lambda ps: torch.optim.SGD(ps, **kw, foreach=False)}, per_param_rw=20)
