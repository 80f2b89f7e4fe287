"""Tensor-parallel layers on 2 and 4 Gloo ranks against the unsharded nn.Linear / nn.Embedding in
float64: outputs and every gradient (fp32, relative error <= 1e-6), with and without sequence
parallelism, the asynchronous all-reduce and gradient-accumulation fusion; plus the LayerNorms,
the model-parallel GradScaler and bad-input errors."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from apex.testing import rel_error
from apex.transformer import parallel_state as ps
from apex.transformer import tensor_parallel as tp_
from apex.transformer.amp import GradScaler
from apex.transformer.layers import FastLayerNorm, FusedLayerNorm, MixedFusedLayerNorm
from tests.transformer import _dist

TOL = 1e-6


def _close(out, ref, what):
    err = rel_error(out, ref)
    assert err <= TOL, f"{what}: relative error {err:.3g}"


def _sum_over_tp(t):
    t = t.clone()
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    return t


def _mlp_case(tp, sp, fusion, async_ar, s=8, b=3, h=12):
    r = ps.get_tensor_model_parallel_rank()
    torch.manual_seed(7)  # same master weights and data on every rank
    col = tp_.ColumnParallelLinear(h, 4 * h, gather_output=False, use_cpu_initialization=True,
                                   keep_master_weight_for_test=True, sequence_parallel_enabled=sp,
                                   no_async_tensor_model_parallel_allreduce=not async_ar,
                                   gradient_accumulation_fusion=fusion)
    row = tp_.RowParallelLinear(4 * h, h, input_is_parallel=True, use_cpu_initialization=True,
                                keep_master_weight_for_test=True, sequence_parallel_enabled=sp,
                                gradient_accumulation_fusion=fusion)
    b1, b2 = torch.randn(4 * h), torch.randn(h)
    x, w = torch.randn(s, b, h), torch.randn(s, b, h)
    with torch.no_grad():
        col.bias.copy_(b1.chunk(tp)[r])
        row.bias.copy_(b2)
    if fusion:
        col.weight.main_grad = torch.zeros_like(col.weight)
        row.weight.main_grad = torch.zeros_like(row.weight)
    xin = (x.chunk(tp, 0)[r] if sp else x).clone().requires_grad_()
    hid, _ = col(xin)
    out, _ = row(F.gelu(hid))
    (out * (w.chunk(tp, 0)[r] if sp else w)).sum().backward()

    # float64 reference
    W1, W2 = col.master_weight.double().requires_grad_(), row.master_weight.double().requires_grad_()
    B1, B2 = b1.double().requires_grad_(), b2.double().requires_grad_()
    X = x.double().requires_grad_()
    ref = F.linear(F.gelu(F.linear(X, W1, B1)), W2, B2)
    (ref * w.double()).sum().backward()

    tag = f"tp={tp} sp={sp} fusion={fusion} async={async_ar}"
    _close(out, ref.chunk(tp, 0)[r] if sp else ref, f"{tag} output")
    _close(xin.grad, X.grad.chunk(tp, 0)[r] if sp else X.grad, f"{tag} input grad")
    gw1 = col.weight.main_grad if fusion else col.weight.grad
    gw2 = row.weight.main_grad if fusion else row.weight.grad
    if fusion:
        assert col.weight.grad is None and row.weight.grad is None
    _close(gw1, W1.grad.chunk(tp, 0)[r], f"{tag} column weight grad")
    _close(gw2, W2.grad.chunk(tp, 1)[r], f"{tag} row weight grad")
    _close(col.bias.grad, B1.grad.chunk(tp)[r], f"{tag} column bias grad")
    # under sequence parallelism the replicated bias sees only this rank's tokens (Megatron all-reduces it)
    _close(_sum_over_tp(row.bias.grad) if sp else row.bias.grad, B2.grad, f"{tag} row bias grad")
    assert row.bias.sequence_parallel_enabled == sp


def check_column_row_parallel(rank, world):
    for tp in (1, 2, 4):
        if world % tp:
            continue
        ps.initialize_model_parallel(tp)
        for sp, fusion, async_ar in [(False, False, False), (False, False, True), (False, True, True),
                                     (True, False, False), (True, True, False)]:
            if sp and tp == 1:
                continue
            _mlp_case(tp, sp, fusion, async_ar)
        ps.destroy_model_parallel()


def check_vocab_parallel_embedding(rank, world):
    for tp in (1, 2, 4):
        if world % tp:
            continue
        ps.initialize_model_parallel(tp)
        r = ps.get_tensor_model_parallel_rank()
        torch.manual_seed(11)
        emb = tp_.VocabParallelEmbedding(20, 6, init_method=torch.nn.init.normal_, use_cpu_initialization=True)
        torch.manual_seed(11)
        full = torch.empty(20, 6)
        torch.nn.init.normal_(full)
        ids = torch.randint(0, 20, (5, 7))
        w = torch.randn(5, 7, 6)
        out = emb(ids)
        (out * w).sum().backward()
        W = full.double().requires_grad_()
        ref = F.embedding(ids, W)
        (ref * w.double()).sum().backward()
        _close(out, ref, f"tp={tp} embedding output")
        _close(emb.weight.grad, W.grad.chunk(tp, 0)[r], f"tp={tp} embedding grad")
        assert emb.weight.tensor_model_parallel and emb.weight.partition_dim == 0
        ps.destroy_model_parallel()


def check_tracker_initialisation_differs_per_rank(rank, world):
    ps.initialize_model_parallel(world)
    tp_.model_parallel_cuda_manual_seed(5)
    col = tp_.ColumnParallelLinear(4, 4 * world, init_method=torch.nn.init.normal_)
    expect = torch.empty(4, 4)
    torch.manual_seed(5 + 2718 + rank)
    torch.nn.init.normal_(expect)
    torch.testing.assert_close(col.weight.detach(), expect, rtol=0, atol=0)
    assert tp_.layers.param_is_not_tensor_parallel_duplicate(col.weight)
    assert tp_.layers.param_is_not_tensor_parallel_duplicate(torch.nn.Parameter(torch.ones(1))) == (rank == 0)


def check_gpu_init_of_cpu_tensor_uses_cpu_generator(rank, world):
    """Apex's ``_initialize_affine_weight_gpu`` forks the accelerator's generator only: a CPU tensor given to it
    draws from the default CPU generator, as on a GPU machine (upstream's test_affine_weight_init_*_gpu).
    Both tensors are made on the CPU explicitly: with the ranks on a GPU, a tensor made without a device
    would be moved there."""
    ps.initialize_model_parallel(world)
    tp_.model_parallel_cuda_manual_seed(5)
    torch.manual_seed(11)
    w = torch.empty(3, 4, device="cpu")
    tp_.layers._initialize_affine_weight_gpu(w, torch.nn.init.normal_, 0)
    torch.manual_seed(11)
    torch.testing.assert_close(w, torch.nn.init.normal_(torch.empty(3, 4, device="cpu")), rtol=0, atol=0)
    assert w.tensor_model_parallel and w.partition_dim == 0
    ps.destroy_model_parallel()


def check_bad_input(rank, world):
    ps.initialize_model_parallel(world)
    with pytest.raises(RuntimeError, match="cannot be enabled at the same time"):
        tp_.ColumnParallelLinear(4, 4 * world, sequence_parallel_enabled=True, use_cpu_initialization=True)
    with pytest.raises(RuntimeError, match="input_is_parallel"):
        tp_.RowParallelLinear(4 * world, 4, sequence_parallel_enabled=True, use_cpu_initialization=True)
    with pytest.raises(ValueError, match=f"{4 * world + 1} is not divisible by {world}"):
        tp_.ColumnParallelLinear(4, 4 * world + 1, use_cpu_initialization=True)
    col = tp_.ColumnParallelLinear(4, 4 * world, use_cpu_initialization=True, gradient_accumulation_fusion=True)
    x = torch.randn(2, 3, 4, requires_grad=True)
    with pytest.raises(RuntimeError, match="main_grad"):
        col(x)[0].sum().backward()


def check_grad_scaler_agrees(rank, world):
    ps.initialize_model_parallel(world)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    for step in range(2):
        opt.zero_grad()
        loss = (p * (float("inf") if (step == 0 and rank == 1) else 1.0)).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step == 0:  # rank 1 overflowed: every rank skipped and backed off
            torch.testing.assert_close(p.detach(), torch.ones(3))
            assert scaler.get_scale() == 2.0
    torch.testing.assert_close(p.detach(), torch.full((3,), 0.9))
    assert scaler.get_scale() == 2.0


def test_layer_norms_carry_sequence_parallel_attribute():
    x = torch.randn(4, 3, 8)
    for cls, kwargs in ((FusedLayerNorm, {}), (MixedFusedLayerNorm, {}), (FastLayerNorm, {})):
        ln = cls(8, sequence_parallel_enabled=True, **kwargs)
        assert ln.sequence_parallel_enabled
        assert ln.weight.sequence_parallel_enabled and ln.bias.sequence_parallel_enabled
        torch.testing.assert_close(ln(x), F.layer_norm(x, (8,), ln.weight, ln.bias, 1e-5))
    assert FusedLayerNorm(8).weight.sequence_parallel_enabled is False


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("check", _dist.checks_of(sys.modules[__name__]))
def test_distributed(check, world_size, dist_device):
    _dist.assert_check(__name__, check, world_size, dist_device)
