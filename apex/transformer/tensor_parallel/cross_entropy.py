"""Cross-entropy over vocabulary-parallel logits, without gathering them.

Each tensor-parallel rank holds logits ``z`` for vocabulary ids ``[r*V/T, (r+1)*V/T)``. With ``m`` the
global maximum, ``lse = m + log sum_j exp(z_j - m)`` and ``z_t`` the target's logit,

    loss = lse - z_t                                        (no smoothing)
    loss = lse - (1 - s) z_t - s * mean_j z_j,  s = alpha * V / (V - 1)   (label_smoothing = alpha)

i.e. the smoothing mass ``alpha`` is spread over the ``V - 1`` non-target classes (NeMo's convention, as
upstream Apex), which equals ``F.cross_entropy(..., label_smoothing=s)``. V is the full vocabulary (upstream
used the partition's size, which made smoothed losses depend on the tensor-parallel size).
Two all-reduces: the max, then one sum of [target logit, sum of exp, sum of logits].
The loss is computed in the logits' dtype; pass float32 logits for an fp32 loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from apex._errors import AssertValueError
from apex.transformer.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from apex.transformer.tensor_parallel.utils import VocabUtility


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        if not 0.0 <= label_smoothing < 1.0:
            raise AssertValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if vocab_parallel_logits.shape[:-1] != target.shape:
            raise ValueError(f"target shape {tuple(target.shape)} does not match the logits' leading shape "
                             f"{tuple(vocab_parallel_logits.shape[:-1])}")
        group = get_tensor_model_parallel_group()
        world_size = get_tensor_model_parallel_world_size()
        partition_vocab_size = vocab_parallel_logits.size(-1)
        vocab_size = partition_vocab_size * world_size
        if target.numel() and (int(target.min()) < 0 or int(target.max()) >= vocab_size):
            raise ValueError(f"target ids must be in [0, {vocab_size}), got values in "
                             f"[{int(target.min())}, {int(target.max())}]")
        vocab_start, vocab_end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            partition_vocab_size, get_tensor_model_parallel_rank(), world_size)

        logits_max = vocab_parallel_logits.amax(dim=-1)
        if world_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = vocab_parallel_logits - logits_max.unsqueeze(-1)  # a new tensor: the input is not mutated

        target_mask = (target < vocab_start) | (target >= vocab_end)
        masked_target = (target - vocab_start).masked_fill(target_mask, 0)
        predicted = shifted.gather(-1, masked_target.unsqueeze(-1)).squeeze(-1).masked_fill(target_mask, 0.0)
        sums = [predicted, shifted.exp().sum(dim=-1)]
        if label_smoothing > 0:
            sums.append(shifted.sum(dim=-1))
        stacked = torch.stack(sums)
        if world_size > 1:
            dist.all_reduce(stacked, group=group)
        predicted, sum_exp = stacked[0], stacked[1]
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - predicted
        smoothing = 0.0
        if label_smoothing > 0:
            smoothing = label_smoothing * vocab_size / (vocab_size - 1)
            mean_log_probs = stacked[2] / vocab_size - log_sum_exp
            loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs

        softmax = shifted.exp_().div_(sum_exp.unsqueeze(-1))
        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        ctx.save_for_backward(softmax, target_mask, masked_target)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target = ctx.saved_tensors
        smoothing, vocab_size = ctx.smoothing, ctx.vocab_size
        # d loss / d z_j = p_j - (1 - s) [j == t] - s / V
        grad = softmax.clone()  # the saved softmax stays intact for a retained graph
        hit = (~target_mask).to(grad.dtype) * (1.0 - smoothing)
        grad.scatter_add_(-1, masked_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if smoothing:
            grad.sub_(smoothing / vocab_size)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token cross-entropy (shape of ``target``) of logits split over the tensor-parallel group
    along the last (vocabulary) dimension; see the module docstring for the math."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing)
