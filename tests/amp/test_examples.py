"""Old Apex scripts run with their three-line amp change verbatim (on CPU), and Apex's names import."""

import importlib

import pytest
import torch

# Apex's README / docs example, with only `.cuda()` dropped so it runs on this machine. The three amp
# lines (import, initialize, scale_loss) are verbatim.
README_EXAMPLE = '''
import torch
from apex import amp

N, D_in, D_out = 64, 1024, 16
x = torch.randn(N, D_in)
y = torch.randn(N, D_out)

model = torch.nn.Linear(D_in, D_out)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

model, optimizer = amp.initialize(model, optimizer, opt_level=OPT_LEVEL)

for t in range(20):
    y_pred = model(x)
    loss = torch.nn.functional.mse_loss(y_pred, y)
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
'''

# The pattern of Apex's DCGAN example: two models, two optimizers, three losses with their own scalers.
DCGAN_EXAMPLE = '''
import torch
import torch.nn as nn
from apex import amp

netG = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16), nn.Tanh())
netD = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999))

[netD, netG], [optimizerD, optimizerG] = amp.initialize(
    [netD, netG], [optimizerD, optimizerG], opt_level=OPT_LEVEL, num_losses=3)

for i in range(10):
    real = torch.randn(16, 16)
    netD.zero_grad()
    output = netD(real)
    errD_real = criterion(output, torch.ones_like(output))
    with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
        errD_real_scaled.backward()
    fake = netG(torch.randn(16, 8))
    output = netD(fake.detach())
    errD_fake = criterion(output, torch.zeros_like(output))
    with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
        errD_fake_scaled.backward()
    optimizerD.step()

    netG.zero_grad()
    output = netD(fake)
    errG = criterion(output, torch.ones_like(output))
    with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
        errG_scaled.backward()
    optimizerG.step()
'''


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
def test_readme_example_verbatim(opt_level):
    scope = {"OPT_LEVEL": opt_level}
    exec(compile(README_EXAMPLE, "readme_example", "exec"), scope)
    assert torch.isfinite(scope["loss"]).all()
    assert scope["loss"].item() < torch.nn.functional.mse_loss(torch.zeros_like(scope["y"]), scope["y"]).item() * 2


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_dcgan_example_pattern(opt_level):
    scope = {"OPT_LEVEL": opt_level}
    exec(compile(DCGAN_EXAMPLE, "dcgan_example", "exec"), scope)
    from apex import amp

    sd = amp.state_dict()
    assert list(sd) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]
    assert all(v["unskipped"] == 10 for v in sd.values())
    assert torch.isfinite(scope["errG"]).all()


APEX_NAMES = {
    "apex.amp": ["initialize", "scale_loss", "state_dict", "load_state_dict", "master_params", "disable_casts",
                 "half_function", "float_function", "promote_function", "register_half_function",
                 "register_float_function", "register_promote_function", "init", "_amp_state",
                 "bfloat16_function", "register_bfloat16_function"],
    "apex.amp.frontend": ["initialize", "Properties", "O0", "O1", "O2", "O3", "opt_levels", "state_dict",
                          "load_state_dict"],
    "apex.amp.handle": ["scale_loss", "disable_casts", "AmpHandle", "NoOpHandle"],
    "apex.amp.scaler": ["LossScaler"],
    "apex.amp._amp_state": ["_amp_state", "master_params", "maybe_print", "warn_or_err", "AmpState"],
    "apex.amp._initialize": ["_initialize", "check_models", "check_optimizers", "applier", "to_type"],
    "apex.amp._process_optimizer": ["_process_optimizer", "AmpOptimizerState"],
    "apex.amp.amp": ["init", "half_function", "float_function", "promote_function", "register_half_function",
                     "register_float_function", "register_promote_function"],
    "apex.fp16_utils": ["FP16_Optimizer", "FP16Model", "network_to_half", "convert_network", "convert_module",
                        "BN_convert_float", "tofp16", "prep_param_lists", "model_grads_to_master_grads",
                        "master_params_to_model_params", "to_python_float", "clip_grad_norm", "LossScaler",
                        "DynamicLossScaler"],
    "apex.fp16_utils.fp16util": ["FP16Model", "network_to_half", "convert_network", "convert_module",
                                 "BN_convert_float", "tofp16", "prep_param_lists", "to_python_float",
                                 "model_grads_to_master_grads", "master_params_to_model_params",
                                 "clip_grad_norm"],
    "apex.fp16_utils.fp16_optimizer": ["FP16_Optimizer"],
    "apex.fp16_utils.loss_scaler": ["LossScaler", "DynamicLossScaler", "to_python_float"],
    "amp_C": ["update_scale_hysteresis", "multi_tensor_scale"],
}


@pytest.mark.parametrize("module", list(APEX_NAMES))
def test_apex_names_importable(module):
    mod = importlib.import_module(module)
    missing = [n for n in APEX_NAMES[module] if not hasattr(mod, n)]
    assert not missing, f"{module} lacks {missing}"


def test_from_apex_import_amp_line():
    import apex
    from apex import amp, fp16_utils

    assert apex.amp is amp and apex.fp16_utils is fp16_utils
