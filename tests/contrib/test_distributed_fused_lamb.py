"""DistributedFusedLAMB on 2 and 3 Gloo ranks against apex.optimizers.FusedLAMB in one process on the
gradients averaged over the ranks. Every rank computes the reference itself (the data of every rank is
seeded), so the comparison needs no communication. Spawning ranks is slow on a small machine, so each
spawn runs several scenarios."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB
from apex.optimizers import FusedLAMB
from apex.testing import rel_error, run_distributed

STEPS = 5
TOL = 1e-6


def _model(dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    # ragged sizes, so parameters straddle shards and blocks
    return torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5)).to(dtype)


def _groups(model, wd=0.01):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _batch(rank: int, step: int, micro: int = 0):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(9, 7, generator=g), torch.randn(9, 5, generator=g)


def _loss(model, x, y, gain=1.0):
    return gain * ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).sum()


def _reference_step(model, opt, world, step, micro_batches=1, gain=1.0, clip_each=None):
    """FusedLAMB on the rank-averaged gradient (``clip_each``: clip every rank's gradient to that norm
    before averaging, as clip_after_ar=False does)."""
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for r in range(world):
        for mb in range(micro_batches):
            model.zero_grad()
            _loss(model, *_batch(r, step, mb), gain).backward()
            if mb == 0:
                acc = [p.grad.clone() for p in params]
            else:
                acc = [a + p.grad for a, p in zip(acc, params)]
        if clip_each is not None:
            n = torch.linalg.vector_norm(torch.cat([a.reshape(-1) for a in acc]))
            if n > clip_each:
                acc = [a * (clip_each / n) for a in acc]
        total = [t + a for t, a in zip(total, acc)]
    for p, t in zip(params, total):
        p.grad = t / world
    opt.step()


def _dist_step(model, opt, rank, step, micro_batches=1, gain=1.0, poison=False):
    opt.zero_grad()
    for mb in range(micro_batches):
        opt.set_is_accumulation_step(mb < micro_batches - 1)
        loss = _loss(model, *_batch(rank, step, mb), gain)
        if poison:
            loss = loss * float("inf")
        loss.backward()
    opt.complete_reductions()
    opt.step()


def _close(model, ref, what):
    got = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1).double() for p in ref.parameters()])
    err = rel_error(got, want)
    assert err <= TOL, f"{what}: relative error {err:.3g}"


def _run_case(rank, world, kw, ref_kw, steps=STEPS, micro_batches=1, gain=1.0, poison_step=None, clip_each=None):
    model = _model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedLAMB(_groups(model), **kw)
    ref_opt = FusedLAMB(_groups(ref), **ref_kw)
    # record how many gradients were in when each block's reduce-scatter started
    launches, launch = [], opt._launch_block
    opt._launch_block = lambda b: (None if opt._launched[b] else launches.append((b, sum(opt._taken))), launch(b))
    for s in range(steps):
        poison = s == poison_step and rank == world - 1
        before = [p.detach().clone() for p in model.parameters()]
        state_before = (opt._fp32_m.clone(), opt._fp32_v.clone(), opt._step)
        _dist_step(model, opt, rank, s, micro_batches, gain, poison)
        if s == poison_step:
            assert opt.has_overflow
            assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            assert torch.equal(state_before[0], opt._fp32_m) and torch.equal(state_before[1], opt._fp32_v)
            assert opt._step == state_before[2]
            continue
        assert not opt.has_overflow
        if kw.get("overlap_reductions", True) and kw.get("clip_after_ar", True) and s == 0:
            # blocks were reduced from the hooks, the first while backward still had gradients to produce
            assert len(launches) == opt._num_blocks and launches[0][1] < len(opt._taken), launches
        _reference_step(ref, ref_opt, world, s, micro_batches, gain, clip_each)
        _close(model, ref, f"{kw} step {s}")
    return model, opt


def _scenarios(rank, world):
    base = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, max_grad_norm=1.0)
    ref_base = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, max_grad_norm=1.0)
    # overlapped block reductions, clipping active (gain makes ‖g‖ >> 1), an inf on the last rank at step 2
    model, opt = _run_case(rank, world, dict(base, dwu_num_blocks=4, dwu_num_chunks=2), ref_base, gain=3.0,
                           poison_step=2)
    # each rank holds 1/world of the optimizer state (padding is < pieces * world elements)
    lay = opt._layout
    state_bytes = sum(t.numel() * t.element_size() for t in (opt._fp32_p, opt._fp32_m, opt._fp32_v))
    assert lay.shard_numel * world == lay.padded and lay.padded - lay.total < lay.pieces * world
    assert state_bytes == 3 * 4 * lay.padded // world
    sizes = torch.tensor([state_bytes])
    dist.all_reduce(sizes)
    assert int(sizes) == 3 * 4 * lay.padded
    # no overlap, no clipping, gradient accumulation over 3 micro-batches
    _run_case(rank, world, dict(base, overlap_reductions=False, max_grad_norm=0.0, dwu_num_blocks=1),
              dict(ref_base, max_grad_norm=1e30), micro_batches=3)


def _more_scenarios(rank, world):
    # L2 mode, no grad averaging, no bias correction, NVLAMB, a loss scale
    kw = dict(lr=0.02, betas=(0.8, 0.95), eps=1e-5, max_grad_norm=0.5, adam_w_mode=False, grad_averaging=False,
              bias_correction=False, use_nvlamb=True)
    model = _model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedLAMB(_groups(model), dwu_num_blocks=3, dwu_num_chunks=1, **kw)
    ref_opt = FusedLAMB(_groups(ref), **kw)
    opt.set_global_scale(torch.tensor(64.0))
    for s in range(3):
        _dist_step(model, opt, rank, s, gain=64.0)
        _reference_step(ref, ref_opt, world, s)
        _close(model, ref, f"variants step {s}")
    # clip_after_ar=False: every rank clips its own gradient before the reduction
    base = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6)
    _run_case(rank, world, dict(base, max_grad_norm=1.0, clip_after_ar=False), dict(base, max_grad_norm=1e30),
              steps=3, gain=3.0, clip_each=1.0)
    # dwu_group_size=1: every rank keeps the whole state; the shards are all-reduced across the groups
    _run_case(rank, world, dict(base, max_grad_norm=1.0, dwu_group_size=1), dict(base, max_grad_norm=1.0), steps=2,
              gain=3.0)
    # GradScaler hands itself to step: an inf on one rank skips the step everywhere and halves the scale
    model = _model()
    opt = DistributedFusedLAMB(_groups(model), lr=0.05)
    scaler = torch.amp.GradScaler(next(model.parameters()).device.type, init_scale=256.0)
    for s in range(2):
        opt.zero_grad()
        loss = _loss(model, *_batch(rank, s)) * (float("inf") if s == 1 and rank == 0 else 1.0)
        scaler.scale(loss).backward()  # no set_global_scale: step reads the scaler's scale
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch deprecates the grad_scaler keyword
            scaler.step(opt)
        scaler.update()
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())) == (s == 0)
        if s == 0:  # the loss scale was divided out: the same step as without scaling
            ref = _model()
            ref_opt = DistributedFusedLAMB(_groups(ref), lr=0.05)
            _dist_step(ref, ref_opt, rank, 0)
            _close(model, ref, "GradScaler step")
    assert scaler.get_scale() == 128.0
    # a checkpoint after 3 steps resumes exactly: 2 more steps equal the uninterrupted run
    model = _model()
    opt = DistributedFusedLAMB(_groups(model), lr=0.05, max_grad_norm=1.0)
    for s in range(3):
        _dist_step(model, opt, rank, s)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), opt.state_dict()
    for s in range(3, 5):
        _dist_step(model, opt, rank, s)
    model2 = _model()
    opt2 = DistributedFusedLAMB(_groups(model2), lr=0.05, max_grad_norm=1.0)
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    for s in range(3, 5):
        _dist_step(model2, opt2, rank, s)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    assert torch.equal(opt._fp32_m, opt2._fp32_m) and torch.equal(opt._fp32_v, opt2._fp32_v)
    bad = dict(saved_opt, layout=dict(saved_opt["layout"], world_size=world + 1))
    with pytest.raises(ValueError, match="layout"):
        opt2.load_state_dict(bad)
    assert torch.equal(opt._fp32_m, opt2._fp32_m)  # the failed load changed nothing


def _mixed_params():
    torch.manual_seed(4)
    sizes = ((5, torch.float32), (40, torch.bfloat16), (1, torch.float32), (33, torch.float32), (7, torch.bfloat16),
             (90, torch.float32))
    return torch.nn.ParameterList([torch.nn.Parameter(torch.randn(n).to(dt)) for n, dt in sizes])


def _mixed_loss(params, rank, step):
    return sum(((p.float() * (i + 1 + rank) * (step + 1)).sin().sum() for i, p in enumerate(params)), torch.zeros(()))


def _triton_copies(rank, world):
    """On the Triton path (interpreted on the CPU, compiled on a GPU) the hooks' queued gradients go into the flat
    buffer, divided by the world size, and the gathered parameters back into the model, each with apex's
    multi-tensor scale (as upstream copies), bit for bit what torch.mul and copy_ give: fp32 and bf16 parameters
    in one model (an fp32 buffer), so the write-back casts."""
    import apex
    from apex.contrib.optimizers import distributed_fused_lamb as dfl

    calls = []
    real = dfl.multi_tensor_scale
    dfl.multi_tensor_scale = lambda *a, **k: (calls.append(len(a[2][0])), real(*a, **k))
    if torch.empty(0).device.type == "cpu":
        from apex.testing import prepare_interpreter

        prepare_interpreter()
    try:
        with apex.backend("triton"):
            params = _mixed_params()
            opt = DistributedFusedLAMB(list(params), lr=0.05, dwu_num_blocks=2, dwu_num_chunks=1)
            for step in range(3):
                opt.zero_grad()
                calls.clear()
                _mixed_loss(params, rank, step).backward()
                assert calls, "the queued gradients were not copied by multi_tensor_scale"
                for i, p in enumerate(opt._model_params):
                    assert torch.equal(opt._grad_views[i], torch.mul(p.grad, 1.0 / world).to(opt._flat_dtype)), \
                        (step, i)
                calls.clear()
                opt.step()
                assert calls, "the parameters were not written by multi_tensor_scale"
                flat = opt._new_params.view(world, opt._layout.pieces, opt._layout.piece).transpose(0, 1).reshape(-1)
                for p, o in zip(opt._model_params, opt._layout.offsets):
                    assert torch.equal(p.detach().reshape(-1), flat[o:o + p.numel()].to(p.dtype)), (step, o)
    finally:
        dfl.multi_tensor_scale = real


def test_two_ranks_triton_copies_are_exact(dist_device):
    run_distributed(_triton_copies, 2, timeout_s=120, device=dist_device)


def _follow_changes(rank, world):
    """What a step keeps (the views that write the gathered parameters back, the hooks' queue) follows the
    changes between steps, compared with FusedLAMB on the averaged gradients: a parameter's storage replaced
    (``param.data = ...``), a parameter without a gradient (its hook never runs: zeros), one whose gradient is
    assigned after backward (taken by the reduction), and a model of parameters whose dtype is not the
    buffer's (taken one by one)."""
    for mixed in (False, True):
        model = _mixed_params() if mixed else _model()
        ref = copy.deepcopy(model)
        kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0)
        opt = DistributedFusedLAMB(list(model.parameters()), dwu_num_blocks=2, dwu_num_chunks=1, **kw)
        ps, ref_ps = list(model.parameters()), list(ref.parameters())
        masters = [torch.nn.Parameter(p.detach().float()) for p in ref_ps]  # (the bf16 parameters' fp32 masters)
        ref_opt = FusedLAMB(masters, **kw)

        def loss(m_ps, r, step):  # at step 3 the second parameter takes no part
            return _mixed_loss([p for j, p in enumerate(m_ps) if not (step == 3 and j == 1)], r, step)

        for step in range(5):
            if step == 2:
                for m in (ps, ref_ps):
                    m[0].data = m[0].data.clone()
                masters[0].data = ref_ps[0].detach().float().clone()
            opt.zero_grad()
            (loss(ps, rank, step) if step != 4 else loss(ps, rank, 3)).backward()
            if step == 4:  # no hook saw it: the reduction takes it
                ps[1].grad = torch.full_like(ps[1], 0.5)
            opt.complete_reductions()
            opt.step()
            total = [torch.zeros(p.shape, dtype=torch.float32) for p in ref_ps]
            for r in range(world):
                for p in ref_ps:
                    p.grad = None
                (loss(ref_ps, r, step) if step != 4 else loss(ref_ps, r, 3)).backward()
                if step == 4:
                    ref_ps[1].grad = torch.full_like(ref_ps[1], 0.5)
                for t, p in zip(total, ref_ps):
                    if p.grad is not None:
                        t += p.grad.float() / world
            for w, t in zip(masters, total):
                w.grad = t.to(w.device)
            ref_opt.step()
            with torch.no_grad():
                for p, w in zip(ref_ps, masters):
                    p.copy_(w)
            for dt, tol in ((torch.float32, TOL), (torch.bfloat16, 1e-2)):  # (bf16: its rounding of the master)
                got = [p.detach().double().reshape(-1) for p in ps if p.dtype == dt]
                want = [w.detach().to(dt).double().reshape(-1) for p, w in zip(ps, masters) if p.dtype == dt]
                if got:
                    err = rel_error(torch.cat(got), torch.cat(want))
                    assert err <= tol, (mixed, step, dt, err)


def test_two_ranks_follow_changes():
    run_distributed(_follow_changes, 2, timeout_s=60)


def _step_wrapper(rank, world):
    """step() goes through torch.optim's wrapper (step hooks, the profiler's ``Optimizer.step#...`` range) only
    while a hook or a profiler is there: a plain step opens no range; with hooks, both run once a step and a
    pre hook's new keyword arguments reach step; under a profiler the range is recorded. A step that
    overflows is still skipped (its one host read of the norm finds it not finite) and the values equal
    FusedLAMB's."""
    from torch.autograd.profiler import record_function

    kw = dict(lr=0.05, betas=(0.9, 0.99), eps=1e-6, max_grad_norm=1.0)
    model = _model()
    ref = copy.deepcopy(model)
    opt = DistributedFusedLAMB(_groups(model), **kw)
    ref_opt = FusedLAMB(_groups(ref), **kw)
    entered, calls = [], []
    real_enter = record_function.__enter__
    record_function.__enter__ = lambda self: (entered.append(self.name), real_enter(self))[1]
    try:
        for s in range(5):
            if s == 1:
                pre = opt.register_step_pre_hook(lambda o, a, k: (calls.append("pre"), (a, {**k, "closure": None}))[1])
                post = opt.register_step_post_hook(lambda o, a, k: calls.append(("post", k["closure"])))
            if s == 2:
                pre.remove()
                post.remove()
            opt.zero_grad()
            loss = _loss(model, *_batch(rank, s))
            (loss * float("nan") if s == 4 else loss).backward()
            entered.clear()
            if s == 3:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    opt.step()
                names = {e.name for e in prof.events()}
                assert "Optimizer.step#DistributedFusedLAMB.step" in names, sorted(names)[:20]
            else:
                before = [p.detach().clone() for p in model.parameters()]
                opt.step(closure=(lambda: None) if s == 1 else None)
            if s in (0, 2, 4):
                assert entered == [], entered
            if s == 4:
                assert opt.has_overflow
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                continue
            assert not opt.has_overflow
            _reference_step(ref, ref_opt, world, s)
            _close(model, ref, f"step {s}")
        assert calls == ["pre", ("post", None)], calls
    finally:
        record_function.__enter__ = real_enter


def test_one_rank_step_wrapper_hooks_profiler_overflow():
    run_distributed(_step_wrapper, 1, timeout_s=60)


def _all_scenarios(rank, world):
    _scenarios(rank, world)
    _more_scenarios(rank, world)


def test_two_ranks_match_fused_lamb_clip_overflow_accumulation_checkpoint(dist_device):
    run_distributed(_all_scenarios, 2, timeout_s=60, device=dist_device)


def test_three_ranks_match_fused_lamb():
    run_distributed(_scenarios, 3, timeout_s=60)


@pytest.mark.parametrize("mode", [0, 1])
def test_distributed_lamb_cuda_kernels_match_float64(mode):
    import distributed_lamb_cuda as k

    gen = torch.Generator().manual_seed(mode)
    shapes = [(5, 3), (17,), (2, 2, 3)]
    g = [torch.randn(s, generator=gen) * 40 for s in shapes]
    p = [torch.randn(s, generator=gen) for s in shapes]
    m = [torch.randn(s, generator=gen).abs() * 0.1 for s in shapes]
    v = [torch.rand(s, generator=gen) * 0.1 for s in shapes]
    u = [torch.zeros(s) for s in shapes]
    b1, b2, eps, decay, bc = [0.9, 0.8, 0.7], [0.99, 0.95, 0.9], [1e-6, 1e-5, 1e-4], [0.01, 0.0, 0.1], [1, 0, 1]
    step, scale, max_norm = 3, 8.0, 2.0
    gnorm = float(torch.linalg.vector_norm(torch.cat([x.reshape(-1) for x in g])))
    ref_p, ref_m, ref_v = [x.double() for x in p], [x.double() for x in m], [x.double() for x in v]
    ref_u = []
    combined = scale / min(1.0, max_norm / (gnorm / scale + 1e-6))
    for i in range(3):
        gi = g[i].double() / combined + (decay[i] * ref_p[i] if mode == 0 else 0)
        ref_m[i] = b1[i] * ref_m[i] + (1 - b1[i]) * gi
        ref_v[i] = b2[i] * ref_v[i] + (1 - b2[i]) * gi * gi
        c1, c2 = (1 - b1[i] ** step, 1 - b2[i] ** step) if bc[i] else (1.0, 1.0)
        ref_u.append(ref_m[i] / c1 / ((ref_v[i] / c2).sqrt() + eps[i]) + (decay[i] * ref_p[i] if mode else 0))
    t = torch.tensor
    flag = torch.zeros(1, dtype=torch.int32)
    k.multi_tensor_lamb_compute_update_term(2048, flag, [g, p, m, v, u], t(b1), t(b2), t([0.5] * 3), t(bc),
                                            t([step]), t(eps), mode, t(decay), t(scale), t(gnorm), max_norm)
    for got, want in ((m, ref_m), (v, ref_v), (u, ref_u)):
        for a, b in zip(got, want):
            assert rel_error(a.double(), b) <= TOL
    pn = t([float(x.norm()) for x in ref_p])
    un = t([0.0] + [float(x.norm()) for x in ref_u])  # read through the offsets
    copies = [torch.zeros(s, dtype=torch.float16) for s in shapes[:2]] + [torch.zeros(shapes[2], dtype=torch.uint8)]
    k.multi_tensor_lamb_update_weights(2048, flag, [u, p, copies], pn, un, t([1, 2, 3]), t(0.1), t(decay),
                                       t(gnorm), False)
    for i in range(3):
        ratio = 0.1 * pn[i] / un[i + 1] if decay[i] != 0 else 0.1
        want = ref_p[i] - ratio * ref_u[i]
        assert rel_error(p[i].double(), want) <= TOL
    assert torch.equal(copies[0], p[0].half())
    decoded = (copies[2].to(torch.int16) << 8).view(torch.float16).double()  # e5m2: 2 mantissa bits
    assert rel_error(decoded, p[2].double()) <= 0.125
    # a set noop flag changes nothing
    before = [x.clone() for x in p]
    k.multi_tensor_lamb_update_weights(2048, torch.ones(1, dtype=torch.int32), [u, p, copies], pn, un,
                                       t([1, 2, 3]), t(0.1), t(decay), t(gnorm), True)
    assert all(torch.equal(a, b) for a, b in zip(before, p))


def test_bad_arguments_change_nothing():
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="dwu_num_blocks"):
        DistributedFusedLAMB(params, dwu_num_blocks=0)
    with pytest.raises(ValueError, match="lr"):
        DistributedFusedLAMB(params, lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        DistributedFusedLAMB(params, betas=(0.9, 1.5))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            DistributedFusedLAMB(params)
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("blocks,chunks", [(1, 1), (4, 4), (3, 2)])
def test_layout_shards_cover_every_element_once(world, blocks, chunks):
    from apex.contrib.optimizers._dist_lamb_layout import Layout

    sizes = [91, 13, 0, 65, 5, 1, 300]
    seen = [torch.zeros(n, dtype=torch.int64) for n in sizes]
    for rank in range(world):
        lay = Layout(sizes, world, rank, blocks, chunks)
        assert lay.shard_numel * world == lay.padded >= lay.total == sum(sizes)
        used = torch.zeros(lay.shard_numel, dtype=torch.int64)
        for f in lay.fragments:
            seen[f.param][f.param_offset:f.param_offset + f.length] += 1
            used[f.shard_offset:f.shard_offset + f.length] += 1
            # the shard element sits where the flat layout puts it: piece k, this rank's slice
            flat = lay.offsets[f.param] + f.param_offset
            k = f.shard_offset // lay.piece
            assert flat == k * lay.piece_span + rank * lay.piece + f.shard_offset % lay.piece
        assert int(used.max()) <= 1
    assert all(bool((s == 1).all()) for s in seen)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("blocks,chunks", [(1, 1), (4, 4), (3, 2)])
def test_gather_segments_write_each_parameter_from_the_gathered_shards(world, blocks, chunks):
    """The all-gather's output is rank after rank; the segments must read every parameter element from the
    place its owner's shard put it, each exactly once."""
    from apex.contrib.optimizers._dist_lamb_layout import Layout

    sizes = [91, 13, 0, 65, 5, 1, 300]
    params = [torch.randn(n) for n in sizes]
    shards = []
    for rank in range(world):
        lay = Layout(sizes, world, rank, blocks, chunks)
        shard = torch.full((lay.shard_numel,), float("nan"))
        for f in lay.fragments:
            shard[f.shard_offset:f.shard_offset + f.length] = params[f.param][f.param_offset:f.param_offset + f.length]
        shards.append(shard)
    gathered = torch.cat(shards)
    out = [torch.full((n,), float("nan")) for n in sizes]
    for i, o, g, n in Layout(sizes, world, 0, blocks, chunks).gather_segments():
        assert bool(out[i][o:o + n].isnan().all()), "an element written twice"
        out[i][o:o + n] = gathered[g:g + n]
    assert all(torch.equal(a, b) for a, b in zip(out, params))
