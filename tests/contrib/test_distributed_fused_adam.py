"""``DistributedFusedAdam`` (ZeRO-2) on 2 and 3 Gloo ranks against ``apex.optimizers.FusedAdam`` in one
process on the averaged gradients. Each rank replays every rank's data on a reference model, so the
reference needs no communication. Several configurations share one spawn (spawning is the slow part)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from apex.contrib.optimizers._zero_buckets import _bf16_rem_to_fp32, _fp32_to_bf16_rem
from apex.testing.distributed import run_distributed
from apex.testing.numerics import assert_rel_close

STEPS = 5
TINY_MB = 70 * 4 / 2**20  # 70 fp32 elements: shards of 32, parameters split across buckets


def _model(dtype=torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def _groups(model, lr: float = 0.02) -> list:
    ps = list(model.parameters()) if isinstance(model, nn.Module) else list(model)
    return [{"params": ps[0::2], "lr": 2 * lr}, {"params": ps[1::2]}]


def _data(step: int, micro: int, rank: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)


def _loss(model, x, dy):
    return (model(x) * dy).sum()


def _dfa(model, **kw):
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    kw.setdefault("bucket_cap_mb", TINY_MB)
    return DistributedFusedAdam(_groups(model), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, **kw)


def _ref_step(ref_model, ref_opt, world, step, micro, dtype=torch.float32, clip=None, masters=None):
    """Averaged gradients of every rank's data on the reference model, then one FusedAdam step."""
    ps = list(ref_model.parameters())
    total = [torch.zeros(p.shape, dtype=torch.float32) for p in ps]
    for r in range(world):
        for m in range(micro):
            ref_model.zero_grad(set_to_none=True)
            _loss(ref_model, *_data(step, m, r, dtype)).backward()
            for t, p in zip(total, ps):
                t += p.grad.float() / world
    targets = masters if masters is not None else ps
    for t, p in zip(total, targets):
        p.grad = t
    norm = torch.nn.utils.clip_grad_norm_(targets, clip) if clip else None
    ref_opt.step()
    return norm


def _run_config(rank, world, cfg):
    from apex.optimizers import FusedAdam

    micro = cfg.pop("micro", 1)
    tol = cfg.pop("tol", 1e-6)
    clip = cfg.pop("clip", None)
    bf16 = cfg.get("store_param_remainders", False)
    dtype = torch.bfloat16 if bf16 else torch.float32
    model, ref = _model(dtype), _model(dtype)
    if bf16:
        cfg.update(store_params=False, param_sync_dtype=torch.bfloat16)
    opt = _dfa(model, **cfg)
    masters = [nn.Parameter(p.detach().float()) for p in ref.parameters()] if bf16 else None
    ref_opt = FusedAdam(_groups(masters if bf16 else ref), lr=0.02, betas=(0.8, 0.95),
                        eps=1e-6, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            ctx = opt.no_sync() if m < micro - 1 else torch.enable_grad()
            with ctx:
                _loss(model, *_data(step, m, rank, dtype)).backward()
        norm = opt.clip_grad_norm(clip) if clip else None
        opt.step()
        ref_norm = _ref_step(ref, ref_opt, world, step, micro, dtype, clip, masters)
        if clip:
            assert_rel_close(norm, ref_norm, tol=1e-6, name="grad norm")
        if bf16:  # the reference's bf16 model takes Apex's split of the master (round half up on the bits)
            for p, w in zip(ref.parameters(), masters):
                _fp32_to_bf16_rem(w, p.data, torch.empty(w.shape, dtype=torch.int16))
        if cfg.get("overlap_param_sync") and step == 0:
            assert opt._params_buckets, "overlap_param_sync should leave the all-gathers pending"
            opt.zero_grad()
            assert opt._params_buckets, "zero_grad is no use of the parameters: the all-gathers stay pending"
    if bf16:
        sd = opt.state_dict()
        got = [sd["state"][i]["param"] for i in range(len(masters))]
        # Format 2 holds CPU tensors wherever the optimizer runs (as Apex's _state_dict_v2)
        assert all(t.device.type == "cpu" for t in got), [t.device for t in got]
        in_groups = [p.detach().cpu() for g in _groups(masters) for p in g["params"]]
        assert_rel_close(got, in_groups, tol=1e-6, name=f"masters {cfg}")
        for p, r in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p.detach(), r.detach()), "bf16 params must be the split of the master"
    else:
        assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                         tol=tol, name=f"params {cfg}")
    return opt


def _state_bytes(rank, world):
    """Each rank's moments are 1/world of FusedAdam's (plus bucket padding); the master shard likewise."""
    from apex.optimizers import FusedAdam

    torch.manual_seed(0)
    model, ref = nn.Linear(256, 256), nn.Linear(256, 256)
    n = 256 * 257
    opt, ref_opt = _dfa(model, bucket_cap_mb=1.02 * n * 4 / 2**20), FusedAdam(ref.parameters())
    for m, o in ((model, opt), (ref, ref_opt)):
        m(torch.randn(2, 256)).sum().backward()
        o.step()
    full = sum(s[k].numel() * s[k].element_size() for s in ref_opt.state.values() for k in ("exp_avg", "exp_avg_sq"))
    local = sum(t.numel() * t.element_size() for b in opt.state["buckets"]
                for t in (b.exp_avg_shard, b.exp_avg_sq_shard))
    assert full / world <= local <= 1.05 * full / world, (local, full, world)
    masters = sum(b.params_shard.numel() * 4 for b in opt.state["buckets"])
    assert 4 * n / world <= masters <= 1.05 * 4 * n / world


def _worker_main(rank, world, tmp):
    configs = [
        dict(),
        dict(overlap_grad_sync=False),
        dict(contiguous_grad_buffer=True, contiguous_param_buffer=True),
        dict(micro=3),
        dict(micro=2, contiguous_grad_buffer=True, overlap_param_sync=True),
        dict(store_param_remainders=True),
        dict(clip=0.5, store_params=False),
        dict(param_sync_dtype=torch.int64),
        # whole parameters in one bucket: the hook's fast path queues them (see _deferred_grad_copy)
        dict(bucket_cap_mb=1.0),
        dict(bucket_cap_mb=1.0, micro=3),
        # fp16 master and moments with per-fragment scales: fp16 rounding of the state (2**-11) bounds it
        dict(with_scaled_states=True, dtype=torch.float16, param_sync_dtype=torch.float16, tol=2e-3),
    ]
    for cfg in configs:
        _run_config(rank, world, dict(cfg))
    for cfg in (dict(), dict(overlap_grad_sync=False), dict(contiguous_grad_buffer=True), dict(bucket_cap_mb=1.0)):
        _sometimes_unused(rank, world, cfg)
    _tail_bucket(rank, world)
    _deferred_grad_copy(rank, world)
    _deferred_grad_copy(rank, world, copy_now=16)  # some gradients copied at once, some queued
    _state_bytes(rank, world)
    _last_bucket_fits(rank, world)
    _master_in_gather_buffer(rank, world)
    _accumulate_across_reductions(rank, world)
    _grad_scaler(rank, world)
    _plans_follow_changes(rank, world)
    if world == 2:
        _checkpoint_save(rank, world, tmp)
        _bad_input(rank, world)
    else:
        _checkpoint_load_other_world(rank, world, tmp)


def _grad_scaler(rank, world):
    from apex.optimizers import FusedAdam

    model, ref = _model(), _model()
    opt = _dfa(model)
    ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    scaler = torch.amp.GradScaler(next(model.parameters()).device.type, init_scale=2.0**10, growth_interval=1000)
    for step in range(4):
        opt.zero_grad()
        x, dy = _data(step, 0, rank)
        if step == 2 and rank == 0:
            dy[0, 0] = float("inf")
        scaler.scale(_loss(model, x, dy)).backward()
        if step == 2:
            before = [p.detach().clone() for p in model.parameters()]
            sd_before = opt.state_dict()
        scaler.step(opt)
        scaler.update()
        if step == 2:
            assert scaler.get_scale() == 2.0**9
            assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
            sd_after = opt.state_dict()
            assert sd_after["state"]["step"] == sd_before["state"]["step"] == 2
            for i in range(4):
                for k in ("param", "exp_avg", "exp_avg_sq"):
                    assert torch.equal(sd_after["state"][i][k], sd_before["state"][i][k])
        else:
            _ref_step(ref, ref_opt, world, step, 1)
    assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()], tol=1e-6)


def _ref_step_of(ref, ref_opt, world, loss):
    """The reference step for ``loss(model, rank)``: every rank's gradients averaged (a parameter some rank
    left without a gradient counts zero there), then one step of ``ref_opt``."""
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        loss(ref, r).backward()
        for t, p in zip(total, ref.parameters()):
            if p.grad is not None:
                t += p.grad / world
    for t, p in zip(total, ref.parameters()):
        p.grad = t
    ref_opt.step()


def _tail_bucket(rank, world):
    """A bucket that would leave less than 1/16 of a bucket to spill into one more is made large enough for
    all of it (a last bucket of a few elements would cost a collective per direction every step); a larger
    overflow starts a bucket, and a model smaller than a bucket keeps the default size. Training equals
    FusedAdam either way."""
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
    from apex.optimizers import FusedAdam

    mb = 1024 * 4 / 2**20  # 1024 fp32 elements: buckets of 1024 on 2 ranks (shards of 512), 960 on 3 (320)

    def build(sizes):
        torch.manual_seed(3)
        return nn.ParameterList([nn.Parameter(torch.randn(n)) for n in sizes])

    def loss(m, step, r):
        g = torch.Generator().manual_seed(100 * step + r)
        return sum(((p - torch.randn(p.shape, generator=g)) ** 2).sum() for p in m)

    # fragments start at multiples of 32 elements: (1000, 40) needs 1024 + 64 = 1088 = 17/16 of 1024
    # (the last bucket is then cut to its contents rounded to 32 * world, see _shrink_last_buckets)
    for sizes, buckets in (((1000, 40), [1088] if world == 2 else [960, 192]),
                           ((1000, 200), [1024, 256] if world == 2 else [960, 288]),
                           ((1000,), [1024] if world == 2 else [960, 96])):
        model, ref = build(sizes), build(sizes)
        opt = DistributedFusedAdam(model.parameters(), lr=0.02, bucket_cap_mb=mb)
        ref_opt = FusedAdam(ref.parameters(), lr=0.02)
        for step in range(3):
            opt.zero_grad()
            loss(model, step, rank).backward()
            opt.step()
            _ref_step_of(ref, ref_opt, world, lambda m, r, step=step: loss(m, step, r))
        got = [b.bucket_size for b in opt.state["buckets"]]
        assert got == buckets, (sizes, world, got)
        assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                         tol=1e-6, name=f"buckets for {sizes}")


def _sometimes_unused(rank, world, cfg):
    """A layer that takes part only in even steps: in odd steps its gradient is zero (as in Apex), not the
    previous step's values left in the reused bucket buffer, and a bucket none of whose parameters got a
    gradient is reduced as zeros too."""
    from apex.optimizers import FusedAdam

    def build():
        torch.manual_seed(1)
        return nn.ModuleList([_model(), nn.Linear(5, 3)])

    def loss(m, step, r):
        x, dy = _data(step, 0, r)
        out = m[0](x) + (m[1](x) if step % 2 == 0 else 0)
        return (out * dy).sum()

    model, ref = build(), build()
    opt = _dfa(model, **cfg)
    ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        loss(model, step, rank).backward()
        opt.step()
        _ref_step_of(ref, ref_opt, world, lambda m, r, step=step: loss(m, step, r))
    assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                     tol=1e-6, name=f"sometimes-unused layer {cfg}")


def _last_bucket_fits(rank, world):
    """The last bucket is cut to its contents before its first reduction also when the parameters were placed
    before backward (the contiguous buffers place them in zero_grad), so it communicates no padding."""
    capacity = 4096
    for cfg in (dict(), dict(contiguous_grad_buffer=True, contiguous_param_buffer=True)):
        model = _model()
        opt = _dfa(model, bucket_cap_mb=capacity * 4 / 2**20, **cfg)
        _train(model, opt, rank, range(2))
        (bucket,) = opt.state["buckets"]
        assert bucket.filled_size <= bucket.bucket_size < min(capacity, bucket.filled_size + opt.alignment * world), \
            (cfg, bucket.filled_size, bucket.bucket_size)
        before = dict(opt.comm_stats)
        _train(model, opt, rank, range(2, 3))
        sent = opt.comm_stats["reduce_scatter_bytes"] - before["reduce_scatter_bytes"]
        assert sent == bucket.bucket_size * 4, (cfg, sent)


def _deferred_grad_copy(rank, world, copy_now=None):
    """Once the buckets have their final size, a parameter that is one whole fragment takes the hook's fast
    path: only the first gradient of each bucket goes through _grad_copy, the others are queued and copied
    together when the bucket's reduction starts or backward ends (gradients of ``_COPY_NOW`` elements or
    more are copied at once instead), so after backward no parameter holds a gradient, also when a layer got
    none and its bucket never filled. A backward that fails leaves nothing behind."""
    from apex.contrib.optimizers import _zero_deferred
    from apex.optimizers import FusedAdam

    saved = _zero_deferred._COPY_NOW
    if copy_now is not None:
        _zero_deferred._COPY_NOW = copy_now

    def build():
        torch.manual_seed(2)
        return nn.ModuleList([_model(), nn.Linear(5, 3), nn.Linear(5, 3)])

    def loss(m, step, r):
        x, dy = _data(step, 0, r)
        out = m[0](x) + m[1](x) + (m[2](x) if step % 2 == 0 else 0)
        return (out * dy).sum()

    model, ref = build(), build()
    opt = _dfa(model, bucket_cap_mb=1.0)
    ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    general, queued = [], []
    copy = opt._grad_copy
    opt._grad_copy = lambda p: (general.append(p), copy(p))
    flush = opt._flush_deferred_grads

    def spy(buckets=None):
        queued.extend(p for gb in opt._grads_buckets.values() for p, _ in gb.deferred)
        return flush(buckets)
    opt._flush_deferred_grads = spy
    for step in range(5):
        opt.zero_grad()
        general.clear()
        loss(model, step, rank).backward()
        assert all(p.grad is None for p in model.parameters()), f"gradients left after backward {step}"
        if step >= 3:  # the first step cuts the last bucket to size: its buffer and views change once
            assert len(general) == len(opt.state["buckets"]), (step, len(general))
            limit = _zero_deferred._COPY_NOW
            assert queued and all(p.numel() < limit for p in queued), [p.numel() for p in queued]
            if copy_now is not None:  # the large ones were neither queued nor sent the general way
                large = [p for p in model.parameters() if p.numel() >= limit and all(p is not q for q in general)]
                assert large and all(p is not q for p in large for q in queued)
        queued.clear()
        opt.step()
        _ref_step_of(ref, ref_opt, world, lambda m, r, step=step: loss(m, step, r))
    assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                     tol=1e-6, name="fast gradient hook")
    # A backward that raises after some gradients were queued: zero_grad drops them, the next step is clean.
    opt.zero_grad()

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    x, dy = _data(9, 0, rank)
    out = model[0](Boom.apply(x.requires_grad_())) + model[1](x)  # model[1]'s gradients arrive before the failure
    with pytest.raises(RuntimeError, match="boom"):
        (out * dy).sum().backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert not any(gb.deferred for gb in opt._grads_buckets.values())
    _zero_deferred._COPY_NOW = saved


def _master_in_gather_buffer(rank, world):
    """The fp32 master shard is this rank's part of the reused all-gather buffer (Adam updates what is sent,
    nothing is copied between them); a checkpoint loaded into an optimizer that has stepped lands in it, and a
    format-1 state holds the shard alone, not the whole buffer behind it."""
    import warnings

    model = _model()
    opt = _dfa(model)
    _train(model, opt, rank, range(2))
    for i, b in enumerate(opt.state["buckets"]):
        own = opt._comm_buffers[("params", i)][rank * b.shard_size:(rank + 1) * b.shard_size]
        assert b.params_shard.data_ptr() == own.data_ptr(), i
    sd = opt.state_dict()
    weights = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, rank, range(2, 4))
    expected = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    opt.load_state_dict(sd)
    _train(model, opt, rank, range(2, 4))
    assert all(torch.equal(a, p.detach()) for a, p in zip(expected, model.parameters())), "resume after load"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = opt.state_dict(state_dict_format=1, gather_on_root=False)
    for b, live in zip(local["state"]["buckets"], opt.state["buckets"]):
        assert torch.equal(b.params_shard, live.params_shard)
        assert b.params_shard.untyped_storage().nbytes() == b.params_shard.numel() * 4


def _plans_follow_changes(rank, world):
    """A step keeps what it planned (the parameters' placement, the copy of the gathered buckets into the
    parameters, the lists of its Adam launch) while nothing they depend on changes. Each change here comes
    after steps that built those plans, and the parameters must still equal FusedAdam's: a parameter's
    storage replaced (``param.data = ...``), a gradient no hook saw (assigned after backward), a new
    parameter group, and a format-1 checkpoint loaded (new buckets) into an optimizer that has stepped."""
    import copy
    import warnings

    from apex.optimizers import FusedAdam

    model, ref = _model(), _model()
    extra, ref_extra = (nn.Parameter(torch.linspace(-1, 1, 6)) for _ in range(2))
    opt = _dfa(model)
    ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)

    def loss(m, e, step, r):
        x, dy = _data(step, 0, r)
        out = _loss(m, x, dy)
        if step >= 5:  # the new group's parameter takes part
            out = out + (e * torch.arange(6.0) * (r + 1)).sum()
        if step == 4:  # a gradient of 0.5 on the second parameter, given after backward (no hook sees it)
            out = out + 0.5 * list(m.parameters())[1].sum()
        return out

    for step in range(8):
        if step == 3:
            for m in (model, ref):
                m[0].weight.data = m[0].weight.data.clone()
        if step == 5:
            # (no bias correction: DistributedFusedAdam counts steps for all groups, FusedAdam per group)
            opt.add_param_group({"params": [extra], "lr": 0.01, "bias_correction": False})
            ref_opt.add_param_group({"params": [ref_extra], "lr": 0.01, "bias_correction": False})
        opt.zero_grad()
        x, dy = _data(step, 0, rank)
        (loss(model, extra, step, rank) if step != 4 else _loss(model, x, dy)).backward()
        if step == 4:
            model[0].bias.grad = torch.full_like(model[0].bias, 0.5)
        opt.step()
        ref_ps = [*ref.parameters(), ref_extra]
        _ref_step_of(_Both(ref, ref_ps), ref_opt, world, lambda m, r, step=step: loss(ref, ref_extra, step, r))
        assert_rel_close([p.detach() for p in [*model.parameters(), extra]], [p.detach() for p in ref_ps],
                         tol=1e-6, name=f"step {step}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (deep-copied: like torch.optim's, a state dict not gathered refers to the live state)
        sd = copy.deepcopy(opt.state_dict(state_dict_format=1, gather_on_root=False))
    weights = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, rank, range(8, 10))
    expected = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p, w in zip(model.parameters(), weights):
            p.copy_(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.load_state_dict(sd)
    _train(model, opt, rank, range(8, 10))
    assert all(torch.equal(a, p.detach()) for a, p in zip(expected, model.parameters())), "resume after format-1 load"


class _Both:
    """A model whose ``parameters()`` are the given list (the reference's model and its added group)."""

    def __init__(self, model, params):
        self.model, self.params = model, params

    def parameters(self):
        return iter(self.params)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def _train(model, opt, rank, steps):
    for step in steps:
        opt.zero_grad()
        _loss(model, *_data(step, 0, rank)).backward()
        opt.step()


def _checkpoint_save(rank, world, tmp):
    model = _model()
    opt = _dfa(model)
    _train(model, opt, rank, range(3))
    sd = opt.state_dict()
    weights = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, rank, range(3, 5))
    # Same world size: resume bit for bit.
    model2 = _model()
    with torch.no_grad():
        for p, w in zip(model2.parameters(), weights):
            p.copy_(w)
    opt2 = _dfa(model2, bucket_cap_mb=TINY_MB * 3)  # a different bucketing loads the same state
    opt2.load_state_dict(sd)
    sd2 = opt2.state_dict()
    for i in range(4):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd2["state"][i][k], sd["state"][i][k])
    _train(model2, opt2, rank, range(3, 5))
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(model.parameters(), model2.parameters()))
    if rank == 0:
        torch.save({"sd": sd, "weights": weights}, os.path.join(tmp, "ckpt.pt"))


def _checkpoint_load_other_world(rank, world, tmp):
    from apex.optimizers import FusedAdam

    saved = torch.load(os.path.join(tmp, "ckpt.pt"), weights_only=False)
    sd, weights = saved["sd"], saved["weights"]
    model, ref = _model(), _model()
    with torch.no_grad():
        for p, r, w in zip(model.parameters(), ref.parameters(), weights):
            p.copy_(w)
            r.copy_(w)
    opt = _dfa(model)
    opt.load_state_dict(sd)
    again = opt.state_dict()
    for i in range(4):
        for k in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(again["state"][i][k], sd["state"][i][k])
    assert again["state"]["step"] == 3
    ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    ref_sd = ref_opt.state_dict()
    ref_sd["state"] = {i: {"exp_avg": sd["state"][i]["exp_avg"].clone(), "exp_avg_sq":
                           sd["state"][i]["exp_avg_sq"].clone(), "step": torch.tensor(3.0)} for i in range(4)}
    for g in ref_sd["param_groups"]:
        g["step"] = 3
    ref_opt.load_state_dict(ref_sd)
    for step in range(3, 5):
        opt.zero_grad()
        _loss(model, *_data(step, 0, rank)).backward()
        opt.step()
        _ref_step(ref, ref_opt, world, step, 1)
    assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()], tol=1e-6)
    # A format-1 checkpoint of another world size is refused, and nothing changes.
    with pytest.raises(ValueError, match="2 ranks"):
        opt.load_state_dict({"gathered_states": [torch.zeros(1, dtype=torch.uint8)] * 2, "format": 1})


def _bad_input(rank, world):
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam

    with pytest.raises(TypeError, match="floating-point"):
        DistributedFusedAdam([nn.Parameter(torch.ones(3, dtype=torch.int32), requires_grad=False)])
    with pytest.raises(ValueError, match="one device"):
        DistributedFusedAdam([nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3, device="meta"))])
    with pytest.raises(RuntimeError, match="store_params=True"):
        DistributedFusedAdam(_model(torch.bfloat16).parameters(), store_param_remainders=True,
                             param_sync_dtype=torch.bfloat16)
    model = _model()
    opt = _dfa(model)
    _train(model, opt, rank, range(1))
    sd = opt.state_dict()
    bad = opt.state_dict()
    bad["state"][3]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match="elements"):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert all(torch.equal(after["state"][i][k], sd["state"][i][k]) for i in range(4)
               for k in ("param", "exp_avg", "exp_avg_sq"))
    assert after["param_groups"][0]["lr"] == sd["param_groups"][0]["lr"]
    # A parameter the optimizer does not hold, after one it does: nothing placed, no state entry, the open
    # buckets still open.
    model = _model()
    opt = _dfa(model)
    held = list(model.parameters())
    opt.init_params(held[:1])
    before = (len(opt.state), len(opt.state["buckets"]), [b.able_to_fill for b in opt.state["buckets"]])
    foreign = nn.Parameter(torch.ones(3))
    for init in (opt.init_params, opt.init_params_bucket):
        with pytest.raises(ValueError, match="does not hold"):
            init([held[1], foreign])
        assert (len(opt.state), len(opt.state["buckets"]), [b.able_to_fill for b in opt.state["buckets"]]) == before
        assert foreign not in opt.state and held[1] not in opt.state


def _accumulate_across_reductions(rank, world):
    """Two backwards per step, the first one's buckets reduced before the second (its hooks find them full):
    the second adds to the reduced shard. That shard lives in the first backward's bucket buffer (on one
    rank the whole buffer, on several this rank's chunk of it), so the second backward must not write into
    it again."""
    from apex.optimizers import FusedAdam

    for cfg in (dict(), dict(contiguous_grad_buffer=True)):
        model, ref = _model(), _model()
        opt = _dfa(model, **cfg)
        ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
        for step in range(3):
            opt.zero_grad()
            _loss(model, *_data(step, 0, rank)).backward()
            if step == 2:
                opt.grad_sync()  # an explicit reduction between the two backwards
            _loss(model, *_data(step, 1, rank)).backward()
            opt.step()
            _ref_step(ref, ref_opt, world, step, 2)
        assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                         tol=1e-6, name=f"two backwards per step {cfg}")


def test_one_rank_accumulates_across_reductions():
    run_distributed(_accumulate_across_reductions, 1, timeout_s=60)


def test_bf16_remainder_split_is_exact():
    x = torch.randn(4099) * torch.logspace(-20, 20, 4099)
    bf16, rem, back = torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16), \
        torch.empty_like(x)
    _fp32_to_bf16_rem(x, bf16, rem)
    _bf16_rem_to_fp32(bf16, rem, back)
    assert torch.equal(back.view(torch.int32), x.view(torch.int32))
    assert ((bf16.float() - x).abs() <= x.abs() * 2.0**-8).all()


def test_two_then_three_ranks(tmp_path, dist_device):
    """All configurations on 2 ranks (saving a checkpoint), then on 3 ranks (resuming it). With the ranks on a
    GPU, 2 only: past two ranks the Gloo all-gather sends point to point, which Gloo cannot do from device
    memory."""
    run_distributed(_worker_main, 2, str(tmp_path), timeout_s=60, device=dist_device)
    if dist_device.type == "cpu":
        run_distributed(_worker_main, 3, str(tmp_path), timeout_s=60)


def test_distributed_adam_cuda_kernels_match_fused_adam_math():
    """The ``distributed_adam_cuda`` names: Adam on ``g * grad_scale`` into ``p_in`` with a cast copy in
    ``p_out``; the remainder variant equals the fp32 update of the rebuilt master."""
    import distributed_adam_cuda

    from apex.ops.multi_tensor_adam import multi_tensor_adam

    g = torch.Generator().manual_seed(3)
    sizes = (37, 130)
    p = [torch.randn(n, generator=g) for n in sizes]
    m = [torch.rand(n, generator=g) for n in sizes]
    v = [torch.rand(n, generator=g) for n in sizes]
    grads = [torch.randn(n, generator=g) for n in sizes]
    scale = torch.tensor(0.25)
    args = (1e-2, 0.9, 0.99, 1e-8, 3, 1, 1, 0.1)
    ref_p, ref_m, ref_v = [t.clone() for t in p], [t.clone() for t in m], [t.clone() for t in v]
    flag = torch.zeros(1, dtype=torch.int32)
    multi_tensor_adam(2048, flag, [[x * 0.25 for x in grads], ref_p, ref_m, ref_v], *args)
    out = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    distributed_adam_cuda.multi_tensor_fused_adam(2048, flag, [p, m, v, grads, out], scale, *args)
    for a, b, o in zip(p, ref_p, out):
        assert torch.equal(a, b) and torch.equal(o, b.bfloat16())
    # Remainders: bf16 + int16 hold the fp32 master exactly, before and after the update.
    master = [torch.randn(n, generator=g) for n in sizes]
    bf16 = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    rem = [torch.empty(n, dtype=torch.int16) for n in sizes]
    for w, b, r in zip(master, bf16, rem):
        _fp32_to_bf16_rem(w, b, r)
    m2, v2 = [t.clone() for t in m], [t.clone() for t in v]
    ref_master = [t.clone() for t in master]
    multi_tensor_adam(2048, flag, [[x * 0.25 for x in grads], ref_master, m, v], *args)
    p_out = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    distributed_adam_cuda.multi_tensor_fused_adam_with_param_remainders(
        2048, flag, [bf16, rem, m2, v2, grads, p_out], scale, *args)
    for b, r, w in zip(p_out, rem, ref_master):
        back = torch.empty_like(w)
        _bf16_rem_to_fp32(b, r, back)
        assert torch.equal(back, w)


def _shards_and_replicas(rank, world):
    """4 ranks = 2 shards x 2 replicas: gradients reduce-scattered within {0,1} / {2,3}, then all-reduced
    within {0,2} / {1,3}; the result must still be FusedAdam on the gradients averaged over all 4 ranks."""
    import torch.distributed as dist

    shards = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    for overlap in (True, False):
        opt = _run_config(rank, world, dict(distributed_process_group=shards[rank // 2],
                                            redundant_process_group=replicas[rank % 2],
                                            overlap_grad_sync=overlap))
        assert opt.distributed_size == 2 and opt.redundant_size == 2


def test_four_ranks_two_shards_two_replicas():
    run_distributed(_shards_and_replicas, 4, timeout_s=90)


def _one_rank_keeps_plans(rank, world):
    """On one rank the reduced gradient shard and the gathered parameters are the bucket buffers themselves;
    those buffers are kept from step to step as on several ranks, so the parameter copy's plan and the
    gradient hooks' views are built once: after the first steps every step reuses the same plan object and
    the same gradient buffer, and the values still equal FusedAdam's."""
    from apex.optimizers import FusedAdam

    model, ref = _model(), _model()
    opt = _dfa(model)
    ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    plans, grad_buffers = [], []
    for step in range(5):
        opt.zero_grad()
        _loss(model, *_data(step, 0, rank)).backward()
        grad_buffers.append([opt._comm_buffers.get(("grads", i)) for i in range(len(opt.state["buckets"]))])
        opt.step()
        _ref_step(ref, ref_opt, world, step, 1)
        plans.append(list(opt._param_copy_cache.values()))
    assert all(len(p) == 1 and p[0] is plans[2][0] for p in plans[2:]), "parameter copy plan rebuilt"
    assert all(all(a is b and a is not None for a, b in zip(g, grad_buffers[2])) for g in grad_buffers[2:]), \
        "gradient buffer replaced"
    assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                     tol=1e-6, name="one rank, kept buffers")


def _triton_write_back(rank, world):
    """On the Triton path (interpreted on the CPU, compiled on a GPU) the gathered buckets are written into the
    parameters with apex's multi-tensor copy (multi_tensor_scale by 1.0, as Apex does), not a per-tensor copy:
    each parameter equals its fp32 master rounded once to ``param_sync_dtype`` bit for bit, through fragments
    split across buckets and a bf16 bucket written into fp32 parameters."""
    import apex
    from apex.ops import multi_tensor_scale as mts

    calls = []
    real = mts.multi_tensor_scale
    mts.multi_tensor_scale = lambda *a, **k: (calls.append(len(a[2][0])), real(*a, **k))
    if torch.empty(0).device.type == "cpu":
        from apex.testing import prepare_interpreter

        prepare_interpreter()
    try:
        with apex.backend("triton"):
            for sync in (torch.float32, torch.bfloat16):
                torch.manual_seed(3)
                model = nn.ParameterList([nn.Parameter(torch.randn(n)) for n in (5, 40, 1, 33, 64, 7, 90, 2)])
                opt = _dfa(model, param_sync_dtype=sync)
                for step in range(3):
                    calls.clear()
                    opt.zero_grad()
                    sum(((p * p).sum() * (i + 1) for i, p in enumerate(model)), torch.zeros(())).backward()
                    opt.step()
                    assert calls and sum(calls) >= len(model), (sync, step, calls)
                    params = [p for g in opt.param_groups for p in g["params"]]
                    state = opt.state_dict()["state"]
                    for i, p in enumerate(params):
                        want = state[i]["param"].to(sync).to(p.dtype)
                        assert torch.equal(p.detach().cpu(), want), (sync, step, i)
    finally:
        mts.multi_tensor_scale = real


def test_one_rank_triton_write_back_is_exact(dist_device):
    run_distributed(_triton_write_back, 1, timeout_s=120, device=dist_device)


def _step_wrapper(rank, world):
    """step() goes through torch.optim's wrapper (step hooks, the profiler's ``Optimizer.step#...`` range) only
    while a hook or a profiler is there: a plain step opens no range (entering one cost about as much as the
    Python of a 100-parameter step); with hooks, both run once a step and a pre hook's new keyword arguments
    reach step; under a profiler the range is recorded. The values still equal FusedAdam's."""
    from torch.autograd.profiler import record_function

    from apex.optimizers import FusedAdam

    model, ref = _model(), _model()
    opt = _dfa(model)
    ref_opt = FusedAdam(_groups(ref), lr=0.02, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    entered, calls = [], []
    real_enter = record_function.__enter__
    record_function.__enter__ = lambda self: (entered.append(self.name), real_enter(self))[1]
    try:
        for step in range(4):
            if step == 1:
                pre = opt.register_step_pre_hook(lambda o, a, k: (calls.append("pre"), (a, {**k, "closure": None}))[1])
                post = opt.register_step_post_hook(lambda o, a, k: calls.append(("post", k["closure"])))
            if step == 2:
                pre.remove()
                post.remove()
            opt.zero_grad()
            _loss(model, *_data(step, 0, rank)).backward()
            entered.clear()
            if step == 3:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    opt.step()
                names = {e.name for e in prof.events()}
                assert "Optimizer.step#DistributedFusedAdam.step" in names, sorted(names)[:20]
            else:
                opt.step(closure=(lambda: None) if step == 1 else None)
            if step in (0, 2):
                assert entered == [], entered
            _ref_step(ref, ref_opt, world, step, 1)
        assert calls == ["pre", ("post", None)], calls
    finally:
        record_function.__enter__ = real_enter
    assert_rel_close([p.detach() for p in model.parameters()], [p.detach() for p in ref.parameters()],
                     tol=1e-6, name="steps through and around torch.optim's wrapper")


def _one_rank(rank, world):
    _one_rank_keeps_plans(rank, world)
    _step_wrapper(rank, world)
    _plans_follow_changes(rank, world)
    _deferred_grad_copy(rank, world)  # the hooks' fast path is taken on one rank too
    _master_in_gather_buffer(rank, world)


def test_no_grad_enters_no_context_when_grad_mode_is_off(monkeypatch):
    """The step's helpers (the Adam launch, the deferred gradient copy, the last bucket's cut, the shard cast)
    run with grad mode off: they switch it off themselves only when it is on, and then the caller's mode is
    restored (torch.no_grad's decorator entered a new context on every call)."""
    from apex.contrib.optimizers._zero_buckets import no_grad

    entered = []
    real = torch.no_grad.__enter__
    monkeypatch.setattr(torch.no_grad, "__enter__", lambda self: (entered.append(1), real(self))[1])
    seen = []
    f = no_grad(lambda x: seen.append(torch.is_grad_enabled()) or x)
    with torch.no_grad():
        entered.clear()
        assert f(3) == 3
        assert entered == [] and seen == [False]
    assert f(4) == 4 and seen == [False, False] and entered == [1] and torch.is_grad_enabled()


def test_one_rank_keeps_its_buffers_plans_and_fast_paths(dist_device):
    run_distributed(_one_rank, 1, timeout_s=60, device=dist_device)
