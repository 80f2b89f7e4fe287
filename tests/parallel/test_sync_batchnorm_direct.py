"""SyncBatchNorm's lean eager path (``apex.parallel._syncbn_direct`` over ``apex.ops._syncbn_direct``) against
its general path.

The lean path takes the usual eager call with facts from a plan cached per input shape; every result must
equal the general path's bit for bit (outputs, gradients, running statistics, ``num_batches_tracked``),
including after the cached facts stop holding: another shape, dtype or memory format, the module moved,
converted or reconfigured after a warm call. Calls the general path answers with an error get the same
error, however often they are repeated.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import apex
import apex.parallel.sync_batchnorm as sbn_mod
from apex.parallel import SyncBatchNorm
from apex.testing import assert_rel_close, run_distributed


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts the calls the lean path answers (so that a test knows it ran)."""
    taken = []
    lean = sbn_mod._direct_forward

    def counting(mod, input, z):
        y = lean(mod, input, z)
        if y is not None:
            taken.append(type(y))  # (not y: a test may watch it freed)
        return y

    monkeypatch.setattr(sbn_mod, "_direct_forward", counting)
    return taken


def _general(fn):
    """``fn()`` with the lean path switched off: the general path of ``SyncBatchNorm.forward`` alone."""
    lean = sbn_mod._direct_forward
    sbn_mod._direct_forward = lambda mod, input, z: None
    try:
        return fn()
    finally:
        sbn_mod._direct_forward = lean


def _step(bn, x, gy, need=(True, True, True), z=None):
    """One call and its backward: ``(y, grads of the inputs in need, running mean, var, batches tracked)``;
    ``need``: whether ``x``, the weight, the bias (and ``z``, when given) need a gradient."""
    x = x.detach().clone().requires_grad_(need[0])
    ps = [bn.weight, bn.bias] if bn.affine else []
    for p, n in zip(ps, need[1:3]):
        p.requires_grad_(n)
    if z is not None:
        z = z.detach().clone().requires_grad_(need[3])
    y = bn(x, z)
    wrt = [t for t, n in zip([x, *ps], need) if n] + ([z] if z is not None and need[3] else [])
    grads = torch.autograd.grad(y, wrt, gy) if wrt and y.requires_grad else ()
    stats = [t.clone() if t is not None else None for t in (bn.running_mean, bn.running_var,
                                                            bn.num_batches_tracked)]
    return [y.detach(), *grads, *stats]


def _assert_same(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b)):
        if u is None or v is None:
            assert u is None and v is None, i
        else:
            assert u.dtype == v.dtype and u.shape == v.shape and u.stride() == v.stride(), i
            assert torch.equal(u, v), f"result {i} differs"


# (shape, channel_last, dtype, module keywords, which of x, weight, bias, z need a gradient; z: None for no z,
# else z's dtype and whether it is given strided)
CASES = [
    ((5, 7), False, torch.float32, {}, (True, True, True), None),
    ((3, 7, 13), False, torch.float32, {"momentum": None}, (True, True, True), None),
    ((2, 7, 6, 5), False, torch.float16, {"fuse_relu": True}, (True, False, False), None),
    ((2, 7, 3, 4, 5), False, torch.bfloat16, {}, (False, True, True), None),
    ((3, 5, 4, 7), True, torch.float32, {"fuse_relu": True, "momentum": 0.0}, (True, True, False), None),
    ((4, 9, 7), True, torch.bfloat16, {"affine": False}, (True, False, False), None),
    ((4, 7, 9), False, torch.float32, {"track_running_stats": False}, (True, True, True), None),
    ((6, 7), False, torch.float32, {}, (False, False, False), None),
    ((2, 7, 6, 5), False, torch.float32, {"fuse_relu": True}, (True, True, True, True), (torch.float32, False)),
    ((3, 5, 4, 7), True, torch.float16, {"fuse_relu": True}, (True, False, True, True), (torch.float32, True)),
    ((4, 7, 9), False, torch.bfloat16, {"momentum": None}, (False, True, True, True), (torch.bfloat16, True)),
    ((9, 7), False, torch.float32, {"fuse_relu": True}, (True, True, True, False), (torch.float16, False)),
]


@pytest.mark.parametrize("shape,channel_last,dtype,kw,need,with_z", CASES)
def test_lean_path_equals_general_path_bit_for_bit(backend_name, lean_calls, shape, channel_last, dtype, kw,
                                                   need, with_z):
    C = shape[-1] if channel_last or len(shape) == 2 else shape[1]
    torch.manual_seed(0)
    bn = SyncBatchNorm(C, channel_last=channel_last, **kw)
    if bn.affine:
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-0.5, 0.5)
    twin = copy.deepcopy(bn)
    xs = [(torch.randn(shape) * 2 + i).to(dtype) for i in range(3)]
    gy = torch.randn(shape).to(dtype)
    z = None
    if with_z is not None:
        z = torch.randn(shape).to(with_z[0])
        if with_z[1]:
            z = torch.randn(*shape[:-1], 2 * shape[-1]).to(with_z[0])[..., ::2]  # strided
    for x in xs[:2]:  # a cold and a warm plan
        _assert_same(_step(bn, x, gy, need, z), _general(lambda x=x: _step(twin, x, gy, need, z)))
    off = (False,) * 4
    with torch.no_grad():  # the Function-free call
        _assert_same(_step(bn, xs[2], gy, off, z), _general(lambda: _step(twin, xs[2], gy, off, z)))
    bn.eval()
    twin.eval()
    _assert_same(_step(bn, xs[2], gy, need, z), _general(lambda: _step(twin, xs[2], gy, need, z)))
    if backend_name == "triton":
        assert len(lean_calls) == 4


def _batch_norm_reference(x, bn):
    """The training-mode output in float64 (channel-first or channel-last, as ``bn`` reads ``x``)."""
    last = bn.channel_last and x.dim() > 2
    x64 = (x.movedim(-1, 1) if last else x).double()
    w = bn.weight.detach().double() if bn.affine else None
    b = bn.bias.detach().double() if bn.affine else None
    y = F.batch_norm(x64, None, None, w, b, True, 0.0, bn.eps)
    if bn.fuse_relu:
        y = F.relu(y)
    return y.movedim(1, -1) if last else y


def test_plan_follows_every_fact_it_derives_from(backend_name, lean_calls):
    """Warm calls, then calls whose cached facts no longer hold: another batch, length, rank, memory format,
    stride, dtype; the module reconfigured (channel_last on the same input shape, eps, momentum, fuse_relu)
    and converted (``.half()``). Each equals the general path bit for bit and batch norm's values."""
    torch.manual_seed(1)
    C = 4
    bn = SyncBatchNorm(C)
    twin = copy.deepcopy(bn)

    def both(x, tol=1e-5):
        gy = torch.randn(x.shape).to(x.dtype)
        ours = _step(bn, x, gy)
        _assert_same(ours, _general(lambda: _step(twin, x, gy)))
        assert_rel_close(ours[0], _batch_norm_reference(x, bn), tol=tol, name="out")

    both(torch.randn(4, C, 5, C))  # (warm)
    both(torch.randn(4, C, 5, C))
    both(torch.randn(3, C, 7))  # another batch and length
    both(torch.randn(6, C))  # 2-D: the channel-last layout
    both(torch.randn(2, C, 3, 3).to(memory_format=torch.channels_last))  # another memory format
    both(torch.randn(4, C, 10)[:, :, ::2])  # a strided view
    both(torch.randn(4, C, 5).half(), tol=2e-3)  # another dtype
    for m in (bn, twin):  # the same input shape read channel-last
        m.channel_last = True
    both(torch.randn(4, C, 5, C))
    for m in (bn, twin):
        m.eps, m.momentum, m.fuse_relu = 1e-2, None, True
    both(torch.randn(4, C, 5, C))
    for m in (bn, twin):  # parameters and running statistics converted in place (Module._apply)
        m.half()
    both(torch.randn(4, C, 5, C).half(), tol=2e-3)
    assert bn.running_mean.dtype == torch.float16 and int(bn.num_batches_tracked) == 10
    for m in (bn, twin):
        m.eval()
    both_eval = torch.randn(4, C, 5, C).half()
    _assert_same(_step(bn, both_eval, torch.ones_like(both_eval)),
                 _general(lambda: _step(twin, both_eval, torch.ones_like(both_eval))))
    if backend_name == "triton":
        assert len(lean_calls) == 11


def test_parameters_moved_or_replaced_after_a_warm_call(triton_device, lean_calls):
    """Devices and contiguity are checked at every call: a parameter moved in place (``.data`` replaced, as
    ``Module.to`` does) or a module moved to another device (``meta`` standing in) is refused naming it, the
    running statistics unchanged; a non-contiguous parameter put in place takes the general path."""
    x = torch.randn(6, 4, 3, device=triton_device)
    with apex.backend("triton"):
        bn = SyncBatchNorm(4).to(triton_device)
        bn(x)
        if x.is_cuda:  # (data of another device type can replace a parameter's in place: CPU and CUDA)
            bn.weight.data = bn.weight.data.to("cpu")
            before = bn.running_var.clone()
            for _ in range(2):
                with pytest.raises(ValueError, match="weight is on cpu"):
                    bn(x)
            assert torch.equal(bn.running_var, before) and int(bn.num_batches_tracked) == 1
        moved = SyncBatchNorm(4).to(triton_device)
        moved(x)
        moved.to("meta")
        for _ in range(2):
            with pytest.raises(ValueError, match="weight is on meta"):
                moved(x)
        assert moved.num_batches_tracked.is_meta
        strided = SyncBatchNorm(4).to(triton_device)
        strided(x)
        assert len(lean_calls) == 3
        # The same parameter made non-contiguous in place, then another put in its place.
        strided.weight.data = torch.full((8,), 2.0, device=triton_device)[::2]
        y = strided(x)
        strided.bias = torch.nn.Parameter(torch.ones(8, device=triton_device)[::2])
        y2 = strided(x)
        assert len(lean_calls) == 3  # the general path's PyTorch operators
        ref = F.batch_norm(x.double(), None, None, training=True)
        assert_rel_close(y, 2 * ref, tol=1e-5)
        assert_rel_close(y2, 2 * ref + 1, tol=1e-5)


def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (the error itself is the result)
        return type(e), str(e)
    return None


def test_errors_are_the_general_paths_after_warm_calls(backend_name):
    """A call the general path answers with an error gets the same error (type and message), each time,
    with the same state left behind."""
    bn = SyncBatchNorm(4)
    twin = copy.deepcopy(bn)
    grouped = SyncBatchNorm(4, process_group=object())
    grouped_twin = copy.deepcopy(grouped)
    calls = [  # (input, what the error says; None: whatever the general path does)
        (torch.randn(3, 4), None),
        (torch.randn(1, 4), "more than 1 value"),
        (torch.randn(3, 5), "channels"),
        (torch.randn(3), "dimensions"),
        (torch.ones(3, 4, dtype=torch.int64), None),
        (torch.randn(1, 4, 1), "more than 1 value"),
    ]
    for _ in range(2):
        for x, match in calls:
            ours = _outcome(lambda x=x: bn(x))
            assert ours == _general(lambda x=x: _outcome(lambda: twin(x)))
            if match is not None:
                assert ours is not None and match in ours[1]
        x = torch.randn(3, 4)
        ours = _outcome(lambda x=x: grouped(x))
        assert ours == _general(lambda x=x: _outcome(lambda: grouped_twin(x)))
        assert ours[0] is RuntimeError and "init_process_group" in ours[1]
    _assert_same([bn.running_mean, bn.running_var, bn.num_batches_tracked],
                 [twin.running_mean, twin.running_var, twin.num_batches_tracked])


def test_lean_path_runs_no_operators(backend_name, lean_calls):
    """A training step on the lean path issues no PyTorch operator (eval and momentum=None as on the general
    path: none, and the host's increment)."""
    from apex._backend import interpreting
    from apex.testing import count_eager

    if backend_name != "triton":
        pytest.skip("the PyTorch path is PyTorch operators by design")
    bn = SyncBatchNorm(6, channel_last=True)
    x = (torch.randn(3, 4, 5, 6) + 1).requires_grad_()
    gy = torch.randn(3, 4, 5, 6)

    def step():
        bn(x).backward(gy)
        x.grad = bn.weight.grad = bn.bias.grad = None

    def own(counts):
        ops = dict(counts["ops"])
        if interpreting():
            ops.pop("copy_", None)  # the interpreter's transfers between tensors and numpy arrays
        return ops

    assert own(count_eager(step)) == {}
    with torch.no_grad():
        assert own(count_eager(lambda: bn(x))) == {}
    bn.momentum = None
    assert own(count_eager(step)) == {"add_": 1}
    bn.eval()
    assert own(count_eager(step)) == {}
    assert int(bn.num_batches_tracked) == 3 and len(lean_calls) == 4


def _distributed_worker(rank, world):
    # Each rank's lean call against the general path's, bit for bit, with statistics gathered over the ranks
    # (rank r holds 2 + r samples).
    with apex.backend("triton"):
        for shape, channel_last, momentum in (((2 + rank, 3, 5), False, 0.1), ((2 + rank, 4, 3), True, None)):
            C = shape[-1] if channel_last else shape[1]
            bn = SyncBatchNorm(C, channel_last=channel_last, momentum=momentum)
            twin = copy.deepcopy(bn)
            g = torch.Generator().manual_seed(rank)
            for _ in range(2):
                x, gy = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
                _assert_same(_step(bn, x, gy), _general(lambda twin=twin, x=x, gy=gy: _step(twin, x, gy)))
    assert dist.get_world_size() == world


def test_lean_path_equals_general_path_on_two_ranks():
    run_distributed(_distributed_worker, 2, timeout_s=120.0)


def test_pytorch_path_imports_no_triton():
    """Calls that PyTorch's path takes (CPU tensors, the automatic backend) make no plan: neither they nor
    the eval calls answered by ``F.batch_norm`` import Triton, as before the lean path."""
    import os
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from apex.parallel import SyncBatchNorm\n"
            "m = SyncBatchNorm(4)\n"
            "m(torch.randn(2, 4, 3)); m.eval(); m(torch.randn(2, 4, 3)); m(torch.randn(2, 4))\n"
            "m.channel_last = True; m(torch.randn(2, 3, 4)); m.train(); m(torch.randn(2, 3, 4))\n"
            "print('triton' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "APEX_BACKEND")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_output_and_graph_are_freed_without_the_collector(backend_name, lean_calls):
    """The Function keeps its tensors as saved tensors, nothing in a reference cycle: an output dropped is freed
    at once (the garbage collector off)."""
    import gc
    import weakref

    bn = SyncBatchNorm(4, fuse_relu=True)
    x, z = torch.randn(3, 4, 5, requires_grad=True), torch.randn(3, 4, 5, requires_grad=True)
    gc.disable()
    try:
        y = bn(x, z)
        out = weakref.ref(y)
        del y
        assert out() is None
    finally:
        gc.enable()
    if backend_name == "triton":
        assert len(lean_calls) == 1


def test_lean_and_general_paths_launch_through_one_plan(backend_name, lean_calls, monkeypatch):
    """Both paths launch the kernels through the same cached plan of an ``(N, C, L)`` size (its methods hold each
    kernel's one argument list), as its launches: the general path's launchers ask for the plan the lean path
    holds."""
    if backend_name != "triton":
        pytest.skip("plans are the Triton path's")
    from apex._kernels import sync_batch_norm as kernels
    from apex.ops import _syncbn_direct as direct

    bn = SyncBatchNorm(5, channel_last=True)
    x = torch.randn(3, 4, 5, requires_grad=True)
    bn(x).sum().backward()
    held = direct._PLANS[(x.shape, x.dtype, True, 5)]  # (shape, dtype, channel_last, num_features)
    assert len(lean_calls) == 1 and held is kernels.plan((12, 5, 1))
    asked = []
    plan = kernels.plan
    monkeypatch.setattr(kernels, "plan", lambda ncl: asked.append(plan(ncl)) or asked[-1])
    _general(lambda: bn(x).sum().backward())
    assert len(asked) == 4 and all(p is held for p in asked)  # statistics, normalise, both backward passes
