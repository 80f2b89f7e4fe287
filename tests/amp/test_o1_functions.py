"""O1 user-function casting: decorators, registries, disable_casts, and the autocast lifecycle."""

import types

import pytest
import torch

from apex import amp


def _probe(*args, **kwargs):
    return [a.dtype for a in args if torch.is_tensor(a)] + [v.dtype for v in kwargs.values() if torch.is_tensor(v)]


def _init_o1(half=torch.bfloat16):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return amp.initialize(model, opt, opt_level="O1", half_dtype=half, verbosity=0)


def test_decorators_are_transparent_before_initialize():
    x = torch.randn(2)
    assert amp.half_function(_probe)(x) == [torch.float32]
    assert amp.float_function(_probe)(x.bfloat16()) == [torch.bfloat16]
    assert amp.promote_function(_probe)(x, x.half()) == [torch.float32, torch.float16]


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_float_promote_under_o1(half):
    _keep = _init_o1(half)
    x, i = torch.randn(2), torch.arange(2)
    assert amp.half_function(_probe)(x, i, y=x) == [half, torch.int64, half]
    assert amp.bfloat16_function(_probe)(x) == [torch.bfloat16]
    assert amp.float_function(_probe)(x.to(half), y=x.to(half)) == [torch.float32, torch.float32]
    assert amp.promote_function(_probe)(x, x.to(half)) == [torch.float32, torch.float32]
    assert amp.promote_function(_probe)(x.to(half), x.to(half)) == [half, half]
    # Lists of tensors are cast too (Apex's sequence casts).
    assert amp.half_function(lambda xs: [t.dtype for t in xs])([x, x]) == [half, half]


def test_float_function_really_runs_in_fp32():
    _keep = _init_o1()
    w = torch.randn(8, 8)

    @amp.float_function
    def sensitive(a):
        return a @ w  # a matmul autocast would otherwise run in bf16

    plain = torch.randn(3, 8) @ w
    assert plain.dtype == torch.bfloat16  # O1 casting is on outside
    assert sensitive(torch.randn(3, 8).bfloat16()).dtype == torch.float32


def test_half_function_output_feeds_backward():
    _keep = _init_o1()
    w = torch.randn(4, 4, requires_grad=True)
    out = amp.half_function(lambda a: a * 2)(w)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_disable_casts():
    _keep = _init_o1()
    a, b = torch.randn(2, 2), torch.randn(2, 2)
    assert (a @ b).dtype == torch.bfloat16
    with amp.disable_casts():
        assert (a @ b).dtype == torch.float32
        assert amp.half_function(_probe)(a) == [torch.float32]
    assert (a @ b).dtype == torch.bfloat16
    assert amp.half_function(_probe)(a) == [torch.bfloat16]


def test_register_functions_apply_at_initialize_and_restore():
    mod = types.SimpleNamespace(h=_probe, f=_probe, p=_probe, b=_probe)
    amp.register_half_function(mod, "h")
    amp.register_float_function(mod, "f")
    amp.register_promote_function(mod, "p")
    amp.register_bfloat16_function(mod, "b")
    x = torch.randn(2)
    assert mod.h(x) == [torch.float32]  # nothing happens until initialize
    _keep = _init_o1(torch.float16)
    assert mod.h(x) == [torch.float16]
    assert mod.f(x.half()) == [torch.float32]
    assert mod.p(x, x.half()) == [torch.float32, torch.float32]
    assert mod.b(x) == [torch.bfloat16]
    amp.frontend._reset_casting()
    assert mod.h is _probe and mod.f is _probe  # deactivation restores the originals


def test_register_unknown_name():
    with pytest.raises(ValueError, match="No function named nope"):
        amp.register_half_function(torch, "nope")


def test_register_on_torch_namespace():
    amp.register_float_function(torch, "sigmoid")
    _keep = _init_o1()
    assert torch.sigmoid(torch.randn(3).bfloat16()).dtype == torch.float32
    amp.frontend._reset_casting()
    assert torch.sigmoid(torch.randn(3).bfloat16()).dtype == torch.bfloat16


def test_optimizer_step_runs_without_casts():
    seen = []

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(torch.is_autocast_enabled("cpu"))
            return super().step(closure)

    model = torch.nn.Linear(4, 4)
    opt = Probe(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as s:
        s.backward()
    opt.step()
    assert seen == [False] and torch.is_autocast_enabled("cpu")


def test_reinitialize_switches_casting_off():
    _keep = _init_o1()
    assert torch.is_autocast_enabled("cpu")
    amp.initialize(torch.nn.Linear(2, 2), opt_level="O2", verbosity=0)
    assert not torch.is_autocast_enabled("cpu")


def test_legacy_handle_api():
    handle = amp.init(device_type="cpu")
    assert handle.is_active() and torch.is_autocast_enabled("cpu")
    with pytest.raises(RuntimeError, match="old Amp API is no longer supported"):
        with handle.scale_loss(torch.ones(()), None):
            pass
    amp.frontend._reset_casting()
    assert not torch.is_autocast_enabled("cpu")


def test_casting_ends_when_the_models_are_gone():
    import gc

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    with amp.scale_loss(model(torch.randn(2, 4)).float().sum(), opt) as s:
        s.backward()
    opt.step()
    assert torch.is_autocast_enabled("cpu")
    del model, opt, s
    gc.collect()
    assert not torch.is_autocast_enabled("cpu")


def test_legacy_init_takes_apex_arguments_in_apex_order():
    handle = amp.init(True, "dynamic", True, False, False, patch_type=torch.float16)
    try:
        assert handle.is_active()
        with torch.autocast("cpu", enabled=False):
            pass
        assert torch.get_autocast_dtype("cpu") == torch.float16
    finally:
        amp.frontend._reset_casting()
    with pytest.raises(ValueError, match="patch_type"):
        amp.init(patch_type=torch.float32)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
def test_o1_runs_apex_fp32_functions_in_fp32_on_the_cpu(half):
    """Apex's O1 lists (softmax, the norms, the losses, exp/log/pow, the reductions) run in fp32, which
    CPU autocast alone would leave in half precision; matmul-like ops stay half; nothing changes once
    casting is off."""
    import torch.nn.functional as F

    model, _ = _init_o1(half)
    h = model(torch.randn(3, 4))
    assert h.dtype == half
    target = torch.tensor([0, 1, 2])
    outs = {
        "softmax": F.softmax(h, dim=-1), "log_softmax": torch.log_softmax(h, -1),
        "layer_norm": F.layer_norm(h, (4,)), "cross_entropy": F.cross_entropy(h, target),
        "sum": h.sum(), "mean": torch.mean(h), "norm": h.norm(), "exp": h.exp(), "pow": h ** 2,
        "mse_loss": F.mse_loss(h, torch.zeros(3, 4)),
    }
    for name, out in outs.items():
        assert out.dtype == torch.float32, name
    torch.testing.assert_close(outs["softmax"], torch.softmax(h.float(), -1))
    assert (h @ h.t()).dtype == half and torch.relu(h).dtype == half
    with pytest.raises(NotImplementedError, match="binary_cross_entropy"):
        F.binary_cross_entropy(torch.sigmoid(h), torch.rand(3, 4))
    with pytest.raises(NotImplementedError, match="in-place function exp_"):
        h.detach().clone().exp_()
    x32 = torch.ones(2)
    assert torch.equal(x32.exp_(), torch.full((2,), 2.7182817))  # fp32 tensors are updated as usual
    with amp.disable_casts():
        assert F.softmax(h, -1).dtype == half and h.sum().dtype == half
    amp.frontend._reset_casting()
    assert F.softmax is not None and F.softmax(h, -1).dtype == half and h.sum().dtype == half
    assert not hasattr(F.softmax, "__wrapped_amp__") and not hasattr(torch.Tensor.sum, "__wrapped_amp__")


def test_allow_banned_lets_binary_cross_entropy_through():
    import torch.nn.functional as F

    handle = amp.init(allow_banned=True, device_type="cpu")
    try:
        p = torch.sigmoid(torch.randn(3, 4)).bfloat16()
        F.binary_cross_entropy(p, torch.rand(3, 4).bfloat16())
    finally:
        amp.frontend._reset_casting()
    del handle


@pytest.mark.parametrize("allow_banned", [False, True])
def test_cuda_o1_keeps_apexs_in_place_and_banned_rules(allow_banned):
    """CUDA autocast runs the fp32 lists itself, but has neither of Apex's two other O1 rules: an in-place fp32
    function on a half tensor raises (autocast leaves in-place calls alone: it would run in half), and a
    banned function raises NotImplementedError on half inputs (CUDA autocast's own RuntimeError is not what
    Apex's users catch), or runs in fp32 with ``allow_banned``. (Autocast's CUDA flag is only a thread-local
    switch, so the rules can be checked on CPU tensors without a GPU.)"""
    import torch.nn.functional as F

    h, t = torch.rand(3, dtype=torch.float16), torch.rand(3, dtype=torch.float16)
    handle = amp.init(device_type="cuda", allow_banned=allow_banned)
    try:
        assert torch.is_autocast_enabled("cuda")
        with pytest.raises(NotImplementedError, match="in-place function exp_"):
            h.clone().exp_()
        with pytest.raises(NotImplementedError, match="in-place function log_"):
            torch.log_(h.clone())
        assert torch.equal(torch.ones(2).exp_(), torch.full((2,), 2.7182817))
        if allow_banned:
            out = F.binary_cross_entropy(h, t)
            assert out.dtype == torch.float32
            torch.testing.assert_close(out, F.binary_cross_entropy(h.float(), t.float()))
        else:
            with pytest.raises(NotImplementedError, match="binary_cross_entropy"):
                F.binary_cross_entropy(h, t)
        assert F.binary_cross_entropy(h.float(), t.float()).dtype == torch.float32
    finally:
        amp.frontend._reset_casting()
    del handle
    assert h.clone().exp_().dtype == torch.float16 and "exp_" not in vars(torch.Tensor)
    assert not hasattr(F.binary_cross_entropy, "__wrapped_amp__")


def test_o1_fp32_functions_fill_out_buffers_and_leave_torch_as_it_was():
    import torch.nn.functional as F

    model, _ = _init_o1(torch.bfloat16)
    x = torch.full((3,), 1.0, dtype=torch.bfloat16)
    out = torch.zeros(3, dtype=torch.bfloat16)
    assert torch.exp(x, out=out) is out
    assert torch.equal(out, torch.exp(x.float()).bfloat16())
    with pytest.raises(NotImplementedError, match="exp_"):
        torch.exp_(x.clone())
    amp.frontend._reset_casting()
    # restored: the Tensor methods inherited from the C base class are inherited again
    assert "sum" not in vars(torch.Tensor) and "exp_" not in vars(torch.Tensor)
    assert torch.exp_(x.clone()).dtype == torch.bfloat16 and F.softmax(x, 0).dtype == torch.bfloat16
    del model


def test_disable_casts_is_per_thread():
    import threading

    model, _ = _init_o1(torch.bfloat16)
    x = torch.ones(3, dtype=torch.bfloat16)
    entered, release = threading.Event(), threading.Event()

    def other():
        with amp.disable_casts():
            entered.set()
            release.wait()

    with amp.disable_casts():
        t = threading.Thread(target=other)
        t.start()
        entered.wait()  # both threads are inside disable_casts; this one leaves first
        assert torch.exp(x).dtype == torch.bfloat16
    assert torch.exp(x).dtype == torch.float32  # casting is back on here while the other is still inside
    release.set()
    t.join()
    assert torch.exp(x).dtype == torch.float32  # and stays on after it leaves
    amp.frontend._reset_casting()
    del model


_RNNS = {
    "gru_cell": (lambda: torch.nn.GRUCell(8, 6), (3, 8)),
    "lstm_cell": (lambda: torch.nn.LSTMCell(8, 6), (3, 8)),
    "rnn_cell": (lambda: torch.nn.RNNCell(8, 6), (3, 8)),
    "gru": (lambda: torch.nn.GRU(8, 6, 2), (5, 3, 8)),
    "lstm_bidirectional": (lambda: torch.nn.LSTM(8, 6, 2, bidirectional=True), (5, 3, 8)),
    "rnn_relu": (lambda: torch.nn.RNN(8, 6, nonlinearity="relu"), (5, 3, 8)),
}


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(_RNNS))
def test_rnns_run_in_half_under_o1(half, name):
    # Apex's O1 runs RNNs and RNN cells in half; CPU autocast has no rule for them (and no fp16 LSTM).
    import copy

    make, shape = _RNNS[name]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model).double()
    x = torch.randn(shape)
    _keep = _init_o1(half)
    y = model(x)
    y = y[0] if isinstance(y, tuple) else y
    assert y.dtype == half
    grads = torch.autograd.grad(y.float().sum(), list(model.parameters()))
    assert all(g.dtype == torch.float32 for g in grads)
    amp._amp_state.handle._deactivate()
    ry = ref(x.double())
    ry = ry[0] if isinstance(ry, tuple) else ry
    rgrads = torch.autograd.grad(ry.sum(), list(ref.parameters()))
    tol = 3e-2 if half == torch.bfloat16 else 5e-3
    assert (y.double() - ry).norm() <= tol * ry.norm()
    for g, rg in zip(grads, rgrads):
        assert (g.double() - rg).norm() <= 4 * tol * rg.norm()
