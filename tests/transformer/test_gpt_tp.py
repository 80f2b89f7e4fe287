"""The standalone GPT trained 10 steps with TP=2 on 2 Gloo ranks ends within 1e-5 of the same model
trained in one process (the same code with a tensor-parallel world of one), from the same weights."""

from __future__ import annotations

import sys

import pytest
import torch

from apex.transformer import parallel_state as ps
from apex.transformer import tensor_parallel
from tests.transformer import _dist

STEPS = 10


def _args():
    from apex.transformer.testing import global_vars

    argv, sys.argv = sys.argv, ["gpt"]
    try:
        global_vars.reset_global_variables()
        global_vars.set_global_variables(
            args_defaults={"num_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "max_position_embeddings": 8,
                           "seq_length": 8, "micro_batch_size": 4},
            override_args={"padded_vocab_size": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                           "tensor_model_parallel_size": 2, "world_size": 2})
    finally:
        sys.argv = argv
    return global_vars.get_args()


def _train(model, tokens):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # Adam would amplify rounding noise of ~0 grads
    seq = tokens.size(1) - 2
    position_ids = torch.arange(seq).unsqueeze(0).expand(tokens.size(0), -1)
    losses = []
    for step in range(STEPS):
        shift = step % 2
        batch, labels = tokens[:, shift:shift + seq], tokens[:, shift + 1:shift + 1 + seq]
        loss = model(batch, position_ids, None, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def check_gpt_tp2_matches_one_process(rank, world):
    if world != 2:
        return
    from apex.transformer.testing.standalone_gpt import GPTModel

    _args()
    ps.initialize_model_parallel(2)
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 10))
    # one-process reference: the tensor-parallel world overridden to a single rank
    ps.set_tensor_model_parallel_world_size(1)
    ps.set_tensor_model_parallel_rank(0)
    tensor_parallel.model_parallel_cuda_manual_seed(42)
    reference = GPTModel()
    initial = [p.detach().clone() for p in reference.parameters()]
    ref_losses = _train(reference, tokens)
    ps.set_tensor_model_parallel_world_size(None)
    ps.set_tensor_model_parallel_rank(None)

    tensor_parallel.model_parallel_cuda_manual_seed(42)
    model = GPTModel()
    r = ps.get_tensor_model_parallel_rank()
    params = list(model.parameters())
    assert len(params) == len(initial)
    with torch.no_grad():
        for p, full in zip(params, initial):
            p.copy_(full.chunk(2, dim=p.partition_dim)[r] if getattr(p, "tensor_model_parallel", False) else full)
    losses = _train(model, tokens)
    assert ref_losses[-1] < ref_losses[0]  # it trained
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (step, a, b)
    diff = ref_norm = 0.0
    for p, q in zip(params, reference.parameters()):
        full = p.detach()
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(full) for _ in range(2)]
            torch.distributed.all_gather(parts, full.contiguous(), group=ps.get_tensor_model_parallel_group())
            full = torch.cat(parts, dim=p.partition_dim)
        diff += (full.double() - q.detach().double()).pow(2).sum().item()
        ref_norm += q.detach().double().pow(2).sum().item()
    # all parameters together (a bias that starts at zero has a tiny norm, so per-tensor ratios are noisier)
    assert (diff / ref_norm) ** 0.5 <= 1e-5, (diff / ref_norm) ** 0.5

@pytest.mark.parametrize("check", _dist.checks_of(sys.modules[__name__]))
def test_distributed(check):
    _dist.assert_check(__name__, check, 2)
