"""Interleaved 1F1B schedule (Megatron's virtual pipeline stages).

Each rank holds ``V`` model chunks; chunk ``c`` of rank ``r`` is virtual stage ``c * P + r``. Microbatches go
through the chunks in groups of ``P``, which divides the pipeline bubble by ``V``. Needs the number of
microbatches to be a multiple of ``P`` (checked by :func:`get_forward_backward_func` and here).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from apex._errors import RuntimeTypeError
from apex.transformer import parallel_state
from apex.transformer.pipeline_parallel import p2p_communication
from apex.transformer.pipeline_parallel.schedules.common import (
    Batch,
    FwdStepFunc,
    GradSync,
    backward_step,
    forward_step,
    free_output_tensor,
)
from apex.transformer.pipeline_parallel.utils import get_kth_microbatch, get_model_type, get_num_microbatches

__all__ = ["_forward_backward_pipelining_with_interleaving"]


def _forward_backward_pipelining_with_interleaving(
    forward_step_func: FwdStepFunc,
    batch: list[Batch | None],
    model: list[torch.nn.Module],
    *,
    forward_only: bool,
    tensor_shape: list[int] | torch.Size | None = None,
    dtype: torch.dtype | None = None,
    grad_scaler: Any | None = None,
    disable_autocast: bool = False,
    deallocate_pipeline_outputs: bool = False,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    custom_sync_context_handler: Callable | None = None,
    custom_grad_sync_func: Callable | None = None,
    custom_param_sync_func: Callable | None = None,
    sync_batch_comm: bool = True,
    num_micro_batches_with_partial_activation_checkpoints: int | None = None,
    overlap_p2p_comm: bool = False,
    batch_p2p_comm: bool = True,
    **kwargs,
) -> list[Any | Sequence[torch.Tensor]]:
    """Run the interleaved schedule over ``model`` (one module per virtual stage of this rank).

    Keyword arguments as :func:`forward_backward_pipelining_without_interleaving`. ``overlap_p2p_comm`` is
    accepted but communication is completed inside each exchange. ``custom_grad_sync_func`` /
    ``custom_param_sync_func``, when given, are called once per chunk (after its last backward / before the
    first forward) with the chunk's parameters. Returns the last stage's ``loss_reduced`` values.
    """
    if not isinstance(model, list) or not model:
        raise RuntimeTypeError("the interleaved schedule needs `model` as a non-empty list of modules (one per chunk)")
    if deallocate_pipeline_outputs:
        warnings.warn("`deallocate_pipeline_outputs` is experimental and subject to change.", stacklevel=2)
    if tensor_shape is None or len(tensor_shape) != 3:
        raise ValueError(
            f"`tensor_shape` should be [sequence_length, micro_batch_size, hidden_size] but {tensor_shape}"
        )
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    num_chunks = len(model)
    if get_num_microbatches() % pp_size != 0:
        raise RuntimeError(
            f"number of microbatches ({get_num_microbatches()}) is not divisible by pipeline-parallel size "
            f"({pp_size}) when using interleaved schedule"
        )
    if sequence_parallel_enabled:
        seq, mbs, hidden = tensor_shape
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if seq % tp:
            raise ValueError(f"sequence length {seq} is not divisible by the tensor parallel size {tp}")
        tensor_shape = (seq // tp, mbs, hidden)

    grad_sync = GradSync(custom_sync_context_handler)
    grad_sync.disable()
    comm = dict(tensor_shape=tensor_shape, dtype=dtype, async_comm=async_comm,
                sequence_parallel_enabled=sequence_parallel_enabled, sync_batch_comm=sync_batch_comm,
                batch_p2p_comm=batch_p2p_comm)

    input_tensors: list[list] = [[] for _ in range(num_chunks)]
    output_tensors: list[list] = [[] for _ in range(num_chunks)]
    output_tensor_grads: list[list] = [[] for _ in range(num_chunks)]
    curr_iters = [0] * num_chunks
    losses_reduced: list = []

    total = get_num_microbatches() * num_chunks
    all_warmup = False
    if forward_only:
        num_warmup = total
    elif get_num_microbatches() == pp_size:
        num_warmup, all_warmup = total, True
    else:
        num_warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
    num_remaining = total - num_warmup
    max_outstanding = num_warmup + 1 if num_micro_batches_with_partial_activation_checkpoints is not None else None
    group = pp_size * num_chunks

    def chunk_id(k: int, forward: bool) -> int:
        c = (k % group) // pp_size
        return c if forward else num_chunks - c - 1

    def is_last_microbatch_for_chunk(k: int) -> bool:
        return k // group == total // group - 1 and (k % group) % pp_size == pp_size - 1

    if custom_param_sync_func is not None:
        for m in model:
            custom_param_sync_func(m.parameters())

    def forward_helper(k: int):
        c = chunk_id(k, forward=True)
        parallel_state.set_virtual_pipeline_model_parallel_rank(c)
        if parallel_state.is_pipeline_first_stage() and len(input_tensors[c]) == len(output_tensors[c]):
            input_tensors[c].append(None)
        ckpt = None if max_outstanding is None else \
            k % max_outstanding >= num_micro_batches_with_partial_activation_checkpoints
        out = forward_step(forward_step_func, get_kth_microbatch(batch, curr_iters[c]), model[c],
                           input_tensors[c][-1], losses_reduced, dtype, disable_autocast, ckpt)
        curr_iters[c] += 1
        output_tensors[c].append(out)
        if forward_only:
            input_tensors[c].pop()
            output_tensors[c].pop()
        return out

    def backward_helper(k: int):
        c = chunk_id(k, forward=False)
        parallel_state.set_virtual_pipeline_model_parallel_rank(c)
        if custom_grad_sync_func is None and is_last_microbatch_for_chunk(k):
            grad_sync.enable()
        if parallel_state.is_pipeline_last_stage() and not output_tensor_grads[c]:
            output_tensor_grads[c].append(None)
        grad = backward_step(input_tensors[c].pop(0), output_tensors[c].pop(0), output_tensor_grads[c].pop(0),
                             model_type=get_model_type(model[c]), grad_scaler=grad_scaler,
                             deallocate_pipeline_outputs=deallocate_pipeline_outputs)
        if custom_grad_sync_func is not None and is_last_microbatch_for_chunk(k):
            grad_sync.enable()
            custom_grad_sync_func(model[c].parameters())
        grad_sync.disable()
        return grad

    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    input_tensors[0].append(p2p_communication.recv_forward(**comm))

    # Warm-up.
    for k in range(num_warmup):
        output_tensor = forward_helper(k)
        next_c = chunk_id(k + 1, forward=True)
        recv_prev = not (parallel_state.is_pipeline_first_stage(ignore_virtual=True) and next_c == 0)
        if k == total - 1:
            recv_prev = False
        if parallel_state.is_pipeline_last_stage():  # the virtual rank forward_helper set
            output_tensor = None
        if k == num_warmup - 1 and not forward_only and not all_warmup:
            recv_next = not parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            input_tensor, output_tensor_grad = p2p_communication.send_forward_backward_recv_forward_backward(
                output_tensor, None, recv_prev=recv_prev, recv_next=recv_next, **comm)
            output_tensor_grads[num_chunks - 1].append(output_tensor_grad)
        else:
            input_tensor = p2p_communication.send_forward_recv_forward(output_tensor, recv_prev=recv_prev, **comm)
        if recv_prev:
            input_tensors[next_c].append(input_tensor)
        free_output_tensor(output_tensor, deallocate_pipeline_outputs)

    # Steady state: forward microbatch k + num_warmup, backward microbatch k.
    for k in range(num_remaining):
        fk = k + num_warmup
        output_tensor = forward_helper(fk)
        input_tensor_grad = backward_helper(k)
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id(fk, forward=True))
        if parallel_state.is_pipeline_last_stage():
            output_tensor = None
        parallel_state.set_virtual_pipeline_model_parallel_rank(chunk_id(k, forward=False))
        if parallel_state.is_pipeline_first_stage():
            input_tensor_grad = None
        recv_prev = True
        if parallel_state.is_pipeline_first_stage(ignore_virtual=True):
            next_fc = chunk_id(fk - (pp_size - 1), forward=True)
            if next_fc == num_chunks - 1:
                recv_prev = False
            next_fc += 1
        else:
            next_fc = chunk_id(fk + 1, forward=True)
        recv_next = True
        if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            next_bc = chunk_id(k - (pp_size - 1), forward=False)
            if next_bc == 0:
                recv_next = False
            next_bc -= 1
        else:
            next_bc = chunk_id(k + 1, forward=False)
        if k == num_remaining - 1:
            recv_prev = False
        input_tensor, output_tensor_grad = p2p_communication.send_forward_backward_recv_forward_backward(
            output_tensor, input_tensor_grad, recv_prev=recv_prev, recv_next=recv_next, **comm)
        free_output_tensor(output_tensor, deallocate_pipeline_outputs)
        if recv_prev:
            input_tensors[next_fc].append(input_tensor)
        if recv_next:
            output_tensor_grads[next_bc].append(output_tensor_grad)

    # Cool-down: the outstanding backwards.
    if not forward_only:
        if all_warmup:
            parallel_state.set_virtual_pipeline_model_parallel_rank(num_chunks - 1)
            output_tensor_grads[num_chunks - 1].append(p2p_communication.recv_backward(**comm))
        for k in range(num_remaining, total):
            input_tensor_grad = backward_helper(k)
            next_bc = chunk_id(k + 1, forward=False)
            recv_next = not (parallel_state.is_pipeline_last_stage(ignore_virtual=True) and next_bc == num_chunks - 1)
            if k == total - 1:
                recv_next = False
            if parallel_state.is_pipeline_first_stage():
                input_tensor_grad = None
            output_tensor_grads[next_bc].append(
                p2p_communication.send_backward_recv_backward(input_tensor_grad, recv_next=recv_next, **comm))
    grad_sync.enable()
    parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    return losses_reduced
