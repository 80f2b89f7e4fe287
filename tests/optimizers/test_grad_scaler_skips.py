"""A torch.amp.GradScaler step that finds an inf skips FusedSGD/FusedAdagrad/FusedLARS without touching
parameters or state, and the next finite step is unscaled correctly."""

import pytest

from apex.optimizers import FusedAdagrad, FusedLARS, FusedSGD
from tests.optimizers._common import check_grad_scaler_skips_then_resumes

OPTIMIZERS = {
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1, weight_decay=0.01),
    "FusedLARS": lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_inf_step_is_skipped_then_training_resumes(backend_name, device, name):
    check_grad_scaler_skips_then_resumes(OPTIMIZERS[name], device)
