"""amp.initialize: presets, overrides and their validation, return shapes, model casting, bad input."""

import pytest
import torch
import torch.nn as nn

from apex import amp
from apex.amp import _amp_state
from tests.amp._models import mlp

PRESETS = {
    "O0": dict(enabled=True, opt_level="O0", cast_model_type=torch.float32, patch_torch_functions=False,
               keep_batchnorm_fp32=None, master_weights=False, loss_scale=1.0),
    "O1": dict(enabled=True, opt_level="O1", cast_model_type=None, patch_torch_functions=True,
               keep_batchnorm_fp32=None, master_weights=None, loss_scale="dynamic"),
    "O2": dict(enabled=True, opt_level="O2", cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=True, master_weights=True, loss_scale="dynamic"),
    "O3": dict(enabled=True, opt_level="O3", cast_model_type=torch.float16, patch_torch_functions=False,
               keep_batchnorm_fp32=False, master_weights=False, loss_scale=1.0),
}


@pytest.mark.parametrize("level", list(PRESETS))
def test_presets_are_apex_exactly(level):
    props = amp.opt_levels[level](amp.frontend.Properties())
    assert props.options == PRESETS[level]


@pytest.mark.parametrize("level", list(PRESETS))
def test_presets_on_a_cpu_model(level):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)
    dtypes = {type(m).__name__: m.weight.dtype for m in model if hasattr(m, "weight")}
    want = {"O0": torch.float32, "O1": torch.float32, "O2": torch.bfloat16, "O3": torch.bfloat16}[level]
    assert dtypes["Linear"] == want
    assert dtypes["BatchNorm1d"] == (torch.bfloat16 if level == "O3" else torch.float32)
    out = model(torch.randn(8, 16))
    assert out.dtype == (torch.bfloat16 if level == "O1" else torch.float32)
    scale = amp.state_dict()["loss_scaler0"]["loss_scale"]
    assert scale == (65536.0 if PRESETS[level]["loss_scale"] == "dynamic" else 1.0)
    assert torch.is_autocast_enabled("cpu") == (level == "O1")
    if level == "O2":
        assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
        assert opt.param_groups[0]["params"][0] is not model[0].weight


def test_half_type_choice():
    model = mlp()
    amp.initialize(model, opt_level="O2", cast_model_type=torch.float16, verbosity=0)
    assert model[0].weight.dtype == torch.float16
    model = mlp()
    amp.initialize(model, opt_level="O3", half_dtype=torch.float16, verbosity=0)
    assert model[0].weight.dtype == torch.float16 and model(torch.randn(2, 16)).dtype == torch.float32
    model = mlp()
    amp.initialize(model, opt_level="O1", half_dtype=torch.float16, verbosity=0)
    assert torch.get_autocast_dtype("cpu") == torch.float16 and model(torch.randn(2, 16)).dtype == torch.float16
    assert _amp_state.opt_properties.cast_model_type is None
    with pytest.raises(ValueError, match="half_dtype"):
        amp.initialize(mlp(), opt_level="O2", half_dtype=torch.float64, verbosity=0)


def test_return_shapes():
    m1, m2 = mlp(), mlp(1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.SGD(m2.parameters(), lr=0.1)
    assert amp.initialize(m1, opt_level="O1", verbosity=0) is m1
    r = amp.initialize([m1, m2], opt_level="O1", verbosity=0)
    assert isinstance(r, list) and r == [m1, m2]
    m, o = amp.initialize(m1, o1, opt_level="O1", verbosity=0)
    assert m is m1 and o is o1
    ms, os_ = amp.initialize([mlp(), mlp()], [torch.optim.SGD(m2.parameters(), lr=0.1)], opt_level="O0",
                             verbosity=0)
    assert isinstance(ms, list) and isinstance(os_, list) and len(os_) == 1
    m, os_ = amp.initialize(mlp(), [o2], opt_level="O0", verbosity=0)
    assert isinstance(m, nn.Module) and os_ == [o2]


def test_disabled_is_a_no_op():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    m, o = amp.initialize(model, opt, enabled=False)
    assert m is model and o is opt and not hasattr(opt, "_amp_stash")
    loss = model(torch.randn(4, 16)).sum()
    with amp.scale_loss(loss, opt) as s:
        assert s is loss


@pytest.mark.parametrize("level", ["01", "O4", "o1", "", None])
def test_unknown_opt_level(level):
    model = mlp()
    with pytest.raises(RuntimeError, match="Unexpected optimization level") as e:
        amp.initialize(model, opt_level=level, verbosity=0)
    assert "the prefix O is the letter O, not the number zero" in str(e.value)
    assert model[0].weight.dtype == torch.float32


def test_scale_loss_before_initialize():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="must be called before `with amp.scale_loss`"):
        with amp.scale_loss(model(torch.randn(2, 16)).sum(), opt):
            pass


def test_same_optimizer_twice():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(model, [opt, opt], opt_level="O2", verbosity=0)
    assert not hasattr(opt, "_amp_stash") and model[0].weight.dtype == torch.float32  # nothing changed
    amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="only be passed through amp.initialize once"):
        amp.initialize(mlp(), opt, opt_level="O1", verbosity=0)


class DistributedDataParallel(nn.Module):  # stands for apex.parallel.DistributedDataParallel
    def __init__(self, module):
        super().__init__()
        self.module = module


def test_ddp_wrapped_model_is_refused():
    with pytest.raises(RuntimeError, match="AFTER \n.*returned from amp.initialize"):
        amp.initialize(DistributedDataParallel(mlp()), opt_level="O1", verbosity=0)
    with pytest.raises(RuntimeError, match="torch.nn.parallel.DataParallel"):
        amp.initialize(nn.DataParallel(mlp()), opt_level="O1", verbosity=0)


def test_torch_ddp_is_refused(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match="torch.nn.parallel.DistributedDataParallel"):
            amp.initialize(model, opt_level="O2", verbosity=0)
        assert model.module.weight.dtype == torch.float32
    finally:
        dist.destroy_process_group()


def test_half_model_is_refused():
    with pytest.raises(RuntimeError, match="do not need to call .half()"):
        amp.initialize(mlp().half(), opt_level="O2", verbosity=0)


def test_bad_types():
    with pytest.raises(TypeError, match="models must be"):
        amp.initialize("model", opt_level="O1", verbosity=0)
    with pytest.raises(TypeError, match="optimizers must be"):
        amp.initialize(mlp(), optimizers="sgd", opt_level="O1", verbosity=0)
    with pytest.raises(ValueError, match="num_losses"):
        amp.initialize(mlp(), opt_level="O1", num_losses=0, verbosity=0)


@pytest.mark.parametrize("level,kw,msg", [
    ("O1", dict(cast_model_type=torch.float16), "O1 inserts casts around Torch functions"),
    ("O1", dict(keep_batchnorm_fp32=True), "keep_batchnorm_fp32 should be None"),
    ("O1", dict(master_weights=True), "doesn't make sense to use master_weights with O1"),
    ("O2", dict(patch_torch_functions=True), "patch_torch_functions=True should only be set by"),
])
def test_inconsistent_overrides_raise(level, kw, msg):
    with pytest.raises(RuntimeError, match=msg):
        amp.initialize(mlp(), opt_level=level, verbosity=0, **kw)
    assert not torch.is_autocast_enabled("cpu")


def test_override_forms():
    model = mlp()
    amp.initialize(model, opt_level="O2", keep_batchnorm_fp32="False", loss_scale="128.0", verbosity=0)
    assert _amp_state.opt_properties.keep_batchnorm_fp32 is False
    assert model[1].weight.dtype == torch.bfloat16
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 128.0
    amp.initialize(mlp(), opt_level="O3", loss_scale="dynamic", keep_batchnorm_fp32=True, verbosity=0)
    assert _amp_state.loss_scalers[0].dynamic
    with pytest.raises(ValueError, match="keep_batchnorm_fp32"):
        amp.initialize(mlp(), opt_level="O2", keep_batchnorm_fp32="yes", verbosity=0)
    with pytest.raises(ValueError, match="loss_scale"):
        amp.initialize(mlp(), opt_level="O2", loss_scale="big", verbosity=0)


def test_verbosity_prints_apex_banner(capsys):
    amp.initialize(mlp(), opt_level="O2", verbosity=1)
    out = capsys.readouterr().out
    assert "Selected optimization level O2:  FP16 training with FP32 batchnorm and FP32 master weights." in out
    assert "After processing overrides, optimization options are:" in out
    assert f"{'keep_batchnorm_fp32':22} : True" in out
    amp.initialize(mlp(), opt_level="O2", verbosity=0)
    assert capsys.readouterr().out == ""


def test_cast_model_outputs_and_input_casting():
    model = mlp()
    model.eval()
    amp.initialize(model, opt_level="O2", cast_model_outputs=torch.bfloat16, verbosity=0)
    out = model(torch.randn(3, 16))
    assert out.dtype == torch.bfloat16
    seen = {}

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, extra=None, idx=None):
            seen["x"], seen["extra"], seen["idx"] = x.dtype, extra["t"].dtype, idx.dtype
            return {"out": self.lin(x), "pair": (x, idx)}

    net = Net()
    amp.initialize(net, opt_level="O3", verbosity=0)
    res = net(torch.randn(2, 4), extra={"t": torch.randn(2)}, idx=torch.arange(2))
    assert seen == {"x": torch.bfloat16, "extra": torch.bfloat16, "idx": torch.int64}
    assert res["out"].dtype == torch.float32 and res["pair"][1].dtype == torch.int64
    net = Net()
    amp.initialize(net, opt_level="O1", cast_model_outputs=torch.float32, verbosity=0)
    assert net(torch.randn(2, 4), extra={"t": torch.randn(2)}, idx=torch.arange(2))["out"].dtype == torch.float32


def test_optimizer_state_created_before_initialize_is_recast():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    for p in amp.master_params(opt):
        assert p.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32


def test_closure_with_skipped_step_is_refused():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with amp.scale_loss(model(torch.randn(4, 16)).float().sum(), opt) as s:
        s.backward()
        model[0].weight.grad.view(-1)[0] = float("inf")
    with pytest.raises(RuntimeError, match="closure"):
        opt.step(lambda: None)


def test_apex_ddp_is_refused(tmp_path):
    import torch.distributed as dist

    parallel = pytest.importorskip("apex.parallel")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = parallel.DistributedDataParallel(nn.Linear(2, 2))
        with pytest.raises(RuntimeError, match="apex.parallel.DistributedDataParallel. Parallel wrappers"):
            amp.initialize(model, opt_level="O1", verbosity=0)
    finally:
        dist.destroy_process_group()


def test_larc_wrapped_optimizer_under_o2():
    larc = pytest.importorskip("apex.parallel.LARC")
    model = mlp()
    opt = larc.LARC(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x = torch.randn(8, 16)
    before = model[0].weight.detach().clone()
    for inject in (False, True):
        opt.zero_grad()
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as s:
            s.backward()
            if inject:
                model[0].weight.grad.view(-1)[0] = float("inf")
        snapshot = model[0].weight.detach().clone()
        opt.step()
    assert not torch.equal(before, snapshot) and torch.equal(snapshot, model[0].weight)
    assert all(p.dtype == torch.float32 for p in amp.master_params(opt))
