"""FusedLARS step against the closest PyTorch alternative, torch.optim.SGD with momentum (foreach):
LARS does the same elementwise work plus two norm passes."""

import torch

from apex.optimizers import FusedLARS
from benchmarks.optimizers._common import make_cases


def cases():
    return make_cases(
        "FusedLARS", lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
        {"SGD foreach (no trust ratio)": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4,
                                                                     foreach=True)}, per_param_rw=28)
