"""Host cost of a step: no Python work per parameter once a step has been planned, no host synchronisation
in a capturable step, and a captured CUDA graph that replays the eager steps.

Timings are the benchmark's business (``benchmarks/host/bench_optimizer_host.py``); these tests count
instead. With every Triton launch stubbed, the Python calls a step makes (``sys.setprofile``'s ``call`` and
``c_call`` events: a Python-level loop over the parameters calls something per parameter, while ``map``
over a C function, the way a plan reads the gradients, makes one call) must be the same for 4 and for 40
parameters.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import apex
from apex.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedLARS,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from tests.optimizers._common import grads_for_step, make_params

OPTIMIZERS = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "FusedAdam-capturable-master": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01, capturable=True,
                                                        master_weights=True),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=0.1),
    "FusedLARS": lambda ps: FusedLARS(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2, weight_decay=0.01),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2),
    "FusedMixedPrecisionLamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2, weight_decay=0.01,
                                                                 reduced_precision_dtype=torch.bfloat16),
}


@pytest.fixture
def stubbed_launches():
    """Every Triton launch returns at once (compiled or interpreted): only the host's work runs."""
    pytest.importorskip("triton")
    from benchmarks.host._stub import stubbed_launches as stubbed

    with stubbed():
        yield


def _calls(fn) -> int:
    """The Python calls of ``fn()``, with ``__torch_function__`` handling off: under the test suite's device
    switch a mode (``apex.testing.device.OnDevice``) sees every tensor method, a Python call per tensor that
    a step on the GPU does not make."""
    count = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            count[0] += 1

    # Without the garbage collector: a collection that lands inside the step runs the finalizers of other
    # tests' garbage (weakref callbacks, __del__), Python calls that are not the step's.
    gc.collect()
    gc.disable()
    try:
        with torch._C.DisableTorchFunction():
            sys.setprofile(profile)
            try:
                fn()
            finally:
                sys.setprofile(None)
    finally:
        gc.enable()
    return count[0]


def _params(n: int, dtype=torch.float32):
    params = make_params([(5 + i % 3,) for i in range(n)], dtype)
    for p, g in zip(params, grads_for_step(params, 0)):
        p.grad = g
    return params


def _step_calls(name: str, n: int, fresh_grads: bool) -> int:
    dtype = torch.bfloat16 if name == "FusedMixedPrecisionLamb" else torch.float32
    params = _params(n, dtype)
    opt = OPTIMIZERS[name](params)
    # Other gradient tensors every step, as zero_grad(set_to_none=True) and a backward make: two sets taken in
    # turn, so that their addresses (and the engine's tables for them) are the same from run to run.
    sets = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    turn = [0]

    def new_grads():
        turn[0] ^= 1
        for p, g in zip(params, sets[turn[0]]):
            p.grad = g

    def step():
        if fresh_grads:
            new_grads()
        opt.step()

    with apex.backend("triton"):
        for _ in range(4):
            step()
        # (the least of three: a step's own calls are the same every time; anything else only adds)
        return min(_calls(step) - (_calls(new_grads) if fresh_grads else 0) for _ in range(3))


@pytest.mark.parametrize("fresh_grads", [False, True], ids=["same_grads", "new_grads"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_python_calls_per_step_do_not_grow_with_the_parameters(triton_device, stubbed_launches, name,
                                                               fresh_grads):
    few, many = _step_calls(name, 4, fresh_grads), _step_calls(name, 40, fresh_grads)
    assert many == few, f"{name}: {few} Python calls per step with 4 parameters, {many} with 40"


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_with_new_gradients_starts_no_garbage_collection(triton_device, stubbed_launches, name):
    """Reading the facts of thousands of new gradients keeps no object per tensor alive: a tuple of their
    ``torch.Size`` objects, say, starts a collection every 700 of them, which walks the young objects (the
    new gradients among them) and now and then the whole heap, several times the cost of the reads."""
    dtype = torch.bfloat16 if name == "FusedMixedPrecisionLamb" else torch.float32
    params = _params(2000, dtype)
    opt = OPTIMIZERS[name](params)
    started: list = []

    def count(phase, info):
        if phase == "start":
            started.append(info["generation"])

    with apex.backend("triton"):
        for step in range(4):
            for p in params:
                p.grad = torch.zeros_like(p)  # new tensors, as zero_grad(set_to_none=True) and a backward make
            if step < 3:  # (the first steps plan)
                opt.step()
        gc.collect()  # (the new gradients themselves are not the step's)
        gc.callbacks.append(count)
        try:
            opt.step()
        finally:
            gc.callbacks.remove(count)
    assert not started, f"{name}: the step started {len(started)} garbage collections"


@pytest.mark.parametrize("op", ["scale", "l2norm", "axpby", "adam"])
def test_amp_c_calls_do_not_grow_with_the_tensors(triton_device, stubbed_launches, op):
    import amp_C

    def calls(n: int) -> int:
        xs = [t.detach() for t in _params(n)]
        ys, ms, vs = ([torch.zeros_like(x) for x in xs] for _ in range(3))
        flag = torch.zeros(1, dtype=torch.int32)
        # New Python lists every call, as a caller builds them every step.
        fn = {
            "scale": lambda: amp_C.multi_tensor_scale(65536, flag, [list(xs), list(ys)], 0.5),
            "l2norm": lambda: amp_C.multi_tensor_l2norm(65536, flag, [list(xs)], True),
            "axpby": lambda: amp_C.multi_tensor_axpby(65536, flag, [list(xs), list(ys), list(ys)], 2.0, 1.0, -1),
            "adam": lambda: amp_C.multi_tensor_adam(65536, flag, [list(xs), list(ys), list(ms), list(vs)],
                                                    1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0),
        }[op]
        with apex.backend("triton"):
            fn()
            return _calls(fn)

    assert calls(40) == calls(4)


def test_amp_unscale_calls_do_not_grow_with_the_gradients(triton_device, stubbed_launches):
    from apex.amp.scaler import LossScaler

    def calls(n: int) -> int:
        grads = [p.grad for p in _params(n)]
        scaler = LossScaler("dynamic")
        with apex.backend("triton"):
            scaler.unscale(grads, grads, None, models_are_masters=True)
            return _calls(lambda: scaler.unscale(grads, grads, None, models_are_masters=True))

    assert calls(40) == calls(4)


class _NoHostSync(TorchDispatchMode):
    """Fails on any operator that reads a device value on the host (``.item()``, ``bool(t)``, ``.tolist()``)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default):
            raise AssertionError(f"host synchronisation in a capturable step: {func}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("with_scaler", [False, True], ids=["no_scaler", "grad_scaler"])
@pytest.mark.parametrize("name", ["FusedAdam-capturable-master", "FusedMixedPrecisionLamb"])
def test_capturable_step_reads_nothing_back(triton_device, stubbed_launches, monkeypatch, name, with_scaler):
    def refuse(*args, **kwargs):
        raise AssertionError("tolist() in a capturable step")

    params = _params(6, torch.bfloat16)
    opt = OPTIMIZERS[name](params)
    scaler = torch.amp.GradScaler(triton_device.type, init_scale=2.0 ** 8) if with_scaler else None
    if scaler is not None:
        scaler.scale(torch.ones((), device=triton_device))

    def step():
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)

    with apex.backend("triton"):
        step()  # the first step plans (reading the step counters back once is allowed there)
        if scaler is not None:
            scaler.update()
        monkeypatch.setattr(torch.Tensor, "tolist", refuse)
        with _NoHostSync():
            step()


def _replay_against_eager_steps(device: torch.device, dtype: torch.dtype, with_scaler: bool, shapes, capture) -> None:
    """Capturable FusedAdam steps (with a ``torch.amp.GradScaler``: scale, step, update, as a user's training
    step makes them) taken by ``capture(step)``'s replays, against the same steps of a twin run eagerly:
    parameters, moments and the scaler's state bit-equal. ``capture(warm_up, graphed_step)`` runs the three
    warm-up steps (each taken by both runs), then returns what runs the step again: a CUDA graph's replay, or
    on the CPU the step itself."""
    params = [torch.nn.Parameter(p.to(device)) for p in make_params(shapes, dtype)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def make(ps):
        return FusedAdam(ps, lr=1e-2, weight_decay=0.01, capturable=True, master_weights=dtype != torch.float32)

    def make_scaler():  # (growth_interval: the scale stays 2**8 over the steps, as the static gradients assume)
        return torch.amp.GradScaler(device.type, init_scale=2.0 ** 8, growth_interval=10 ** 6) if with_scaler else None

    opt, ref = make(params), make(twins)
    scaler, ref_scaler = make_scaler(), make_scaler()
    # The loss's gradients of each step are copied into these, the tensors the graph reads. Without a scaler
    # they are the gradients; with one, a step scales them into static gradients of their own, as
    # ``scaler.scale(loss).backward()`` leaves the loss's gradients times the scale (and makes the scaler's
    # scale tensor, at its first call: ``scaler.step`` refuses to run before).
    loss_grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, loss_grads):
        p.grad = g if scaler is None else torch.zeros_like(p)

    def step(o, s, ps, gs, static: bool):
        if s is None:
            o.step()
            return
        for p, g in zip(ps, s.scale(gs)):
            if static:  # into the tensors the graph reads
                p.grad.copy_(g)
            else:
                p.grad = g
        s.step(o)
        s.update()

    def loss_grads_of(step_index, ps):
        return [g.to(device) for g in grads_for_step(ps, step_index)]

    def graphed_step():
        step(opt, scaler, params, loss_grads, static=True)

    def eager_step(step_index):
        gs = loss_grads_of(step_index, twins)
        if ref_scaler is None:
            for p, g in zip(twins, gs):
                p.grad = g
        step(ref, ref_scaler, twins, gs, static=False)

    def load(step_index):
        for buf, g in zip(loss_grads, loss_grads_of(step_index, params)):
            buf.copy_(g)

    def warm_up():  # (plans, tables, compiled kernels) before a capture
        for s in range(3):
            load(s)
            graphed_step()
            eager_step(s)

    replay = capture(warm_up, graphed_step)
    for s in range(3, 8):
        load(s)
        replay()
        eager_step(s)
    if device.type == "cuda":
        torch.cuda.synchronize()
    for a, b in zip(params, twins):
        assert torch.equal(a, b)
    for a, b in zip(params, twins):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[a][key], ref.state[b][key])
    if scaler is not None:  # the graph's replays updated the scaler as the eager steps did
        assert scaler.state_dict() == ref_scaler.state_dict()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("with_scaler", [False, True], ids=["no_scaler", "grad_scaler"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capturable_fused_adam_in_a_cuda_graph_replays_the_eager_steps(dtype, with_scaler):
    def capture(warm_up, graphed_step):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the warm-up on a side stream, as CUDA graph capture asks
            warm_up()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graphed_step()
        return graph.replay

    _replay_against_eager_steps(torch.device("cuda"), dtype, with_scaler, [(33,), (4097,), (3, 5), (70000,)],
                                capture)


@pytest.mark.parametrize("with_scaler", [False, True], ids=["no_scaler", "grad_scaler"])
def test_capturable_fused_adam_steps_the_cuda_graph_test_captures_run_eagerly(triton_device, with_scaler):
    """The CUDA-graph test's steps, run eagerly where the kernels run (the CPU, under the interpreter): what
    it does besides the capture (a GradScaler's scale before its step, say) is checked without a GPU."""
    def capture(warm_up, graphed_step):
        warm_up()
        return graphed_step

    with apex.backend("triton"):
        _replay_against_eager_steps(triton_device, torch.bfloat16, with_scaler, [(33,), (3, 5)], capture)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_alternating_gradient_sets_make_no_new_tables(triton_device, stubbed_launches, monkeypatch, name):
    """Gradients at the addresses of the last step or of the step before (two sets given in turn) launch with
    tables the optimizer holds: no table is made or uploaded, not even found by hashing every address in the
    engine's cache; gradients at new addresses cost one upload, without a new table's making."""
    from apex._kernels import _mt_tables as mt_tables
    from apex._kernels import multi_tensor as mt

    dtype = torch.bfloat16 if name == "FusedMixedPrecisionLamb" else torch.float32
    params = _params(6, dtype)
    opt = OPTIMIZERS[name](params)
    sets = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    made: list = []
    real_table, real_upload = mt.table, mt_tables._upload
    monkeypatch.setattr(mt, "table", lambda lists: (made.append("table"), real_table(lists))[1])
    for owner in (mt, mt_tables):  # (the engine uploads from both: the tables, and group indices)
        monkeypatch.setattr(owner, "_upload", lambda *a: (made.append("upload"), real_upload(*a))[1])
    with apex.backend("triton"):
        for step in range(6):
            for p, g in zip(params, sets[step % 2]):
                p.grad = g
            if step == 3:
                made.clear()
            opt.step()
        held = [b for e in opt._plans.values() if isinstance(e, tuple) and len(e) == 2
                for b in getattr(e[1], "buckets", ()) if getattr(b, "tables", None)]
        if not held:
            pytest.skip(f"{name} launches through its ops (the engine's cache serves it)")
        assert not made, f"{name}: {made} at steps 3-5"
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    assert made == ["upload"] * len(held), f"{name}: {made} for new gradients"
