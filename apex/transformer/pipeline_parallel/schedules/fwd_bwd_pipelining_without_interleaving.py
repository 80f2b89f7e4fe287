"""Non-interleaved 1F1B pipeline schedule: warm-up forwards, steady one-forward-one-backward, cool-down.

Stage ``r`` of ``P`` runs ``min(P - r - 1, m)`` warm-up forwards, then alternates, then finishes the
outstanding backwards, so at most ``P - r`` microbatches' activations are alive at once.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

from apex._errors import AssertValueError
from apex.transformer import parallel_state
from apex.transformer.enums import ModelType
from apex.transformer.pipeline_parallel import p2p_communication
from apex.transformer.pipeline_parallel.schedules.common import (
    Batch,
    FwdStepFunc,
    GradSync,
    backward_step,
    forward_step,
    free_output_tensor,
)
from apex.transformer.pipeline_parallel.utils import (
    get_kth_microbatch,
    get_model_type,
    get_num_microbatches,
    listify_model,
)

__all__ = ["forward_backward_pipelining_without_interleaving"]


def get_tensor_shapes(
    rank: int,
    model_type: ModelType,
    *,
    tensor_shape: list[int] | torch.Size,
    decoder_sequence_length: int | None = None,
    sequence_parallel_enabled: bool = False,
) -> Sequence[Sequence[int]]:
    """Shapes stage ``rank`` sends: ``[(seq, mbs, hidden)]``, plus the decoder's for stages after the split
    of an encoder-and-decoder model. ``seq`` is divided by the TP size with sequence parallelism."""
    if tensor_shape is None or len(tensor_shape) != 3:  # Apex asserts this
        raise AssertValueError(
            f"`tensor_shape` should be [sequence_length, micro_batch_size, hidden_size] but {tensor_shape}"
        )
    seq, mbs, hidden = tensor_shape
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if sequence_parallel_enabled:
        if seq % tp:
            raise ValueError(f"sequence length {seq} is not divisible by the tensor parallel size {tp}")
        seq //= tp
    if model_type != ModelType.encoder_and_decoder:
        return [(seq, mbs, hidden)]
    if decoder_sequence_length is None:
        raise ValueError("decoder_sequence_length is required for encoder-and-decoder models")
    dec = decoder_sequence_length // tp if sequence_parallel_enabled else decoder_sequence_length
    if parallel_state.is_pipeline_stage_before_split(rank):
        return [(seq, mbs, hidden)]
    return [(dec, mbs, hidden), (seq, mbs, hidden)]


def _per_shape(fn, tensors, tensor_shapes, **kw):
    if not isinstance(tensors, list):
        tensors = [tensors]
    return [None if shape is None else fn(t, tensor_shape=shape, **kw) for t, shape in zip(tensors, tensor_shapes)]


def recv_forward(tensor_shapes, **kw):
    return [None if s is None else p2p_communication.recv_forward(tensor_shape=s, **kw) for s in tensor_shapes]


def recv_backward(tensor_shapes, **kw):
    return [None if s is None else p2p_communication.recv_backward(tensor_shape=s, **kw) for s in tensor_shapes]


def send_forward(output_tensors, tensor_shapes, **kw) -> None:
    _per_shape(p2p_communication.send_forward, output_tensors, tensor_shapes, **kw)


def send_backward(input_tensor_grads, tensor_shapes, **kw) -> None:
    _per_shape(p2p_communication.send_backward, input_tensor_grads, tensor_shapes, **kw)


def send_forward_recv_backward(output_tensors, tensor_shapes, **kw):
    return _per_shape(p2p_communication.send_forward_recv_backward, output_tensors, tensor_shapes, **kw)


def send_backward_recv_forward(input_tensor_grads, tensor_shapes, **kw):
    return _per_shape(p2p_communication.send_backward_recv_forward, input_tensor_grads, tensor_shapes, **kw)


def forward_backward_pipelining_without_interleaving(
    forward_step_func: FwdStepFunc,
    batch: Batch | None,
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    forward_only: bool,
    tensor_shape: list[int] | torch.Size | None = None,
    decoder_sequence_length: int | None = None,
    dtype: torch.dtype | None = None,
    grad_scaler: Any | None = None,
    disable_autocast: bool = False,
    deallocate_pipeline_outputs: bool = False,
    async_comm: bool = False,
    sequence_parallel_enabled: bool = False,
    custom_sync_context_handler: Any | None = None,
    custom_grad_sync_func: Any | None = None,
    sync_batch_comm: bool = True,
    num_micro_batches_with_partial_activation_checkpoints: int | None = None,
    **kwargs,
) -> list[Any]:
    """Run the 1F1B schedule over ``get_num_microbatches()`` microbatches of ``batch``.

    ``tensor_shape`` is ``(sequence, micro_batch, hidden)`` of the activations exchanged between stages; they
    travel in ``dtype`` (float32 when None). ``custom_sync_context_handler`` (a null context when None) is
    entered once at the start and left once: on the first pipeline stage just before its last backward, so
    that backward runs with gradient sync on; on every other stage after all backwards, where
    ``custom_grad_sync_func`` (if given, and not ``forward_only``) then runs. Returns the last stage's
    ``loss_reduced`` values (an empty list on other stages).
    """
    if deallocate_pipeline_outputs:
        warnings.warn("`deallocate_pipeline_outputs` is experimental and subject to change.", stacklevel=2)
    model = listify_model(model)
    if len(model) != 1:
        raise RuntimeError(f"`model` is expected be a `nn.Module`, but got a list of {len(model)} modules")
    model = model[0]

    grad_sync = GradSync(custom_sync_context_handler)
    grad_sync.disable()
    num_microbatches = get_num_microbatches()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    num_warmup = min(parallel_state.get_pipeline_model_parallel_world_size() - rank - 1, num_microbatches)
    num_remaining = num_microbatches - num_warmup
    max_outstanding = None
    if num_micro_batches_with_partial_activation_checkpoints is not None:
        max_outstanding = num_warmup + 1

    def checkpoint_flag(k: int) -> bool | None:
        if max_outstanding is None:
            return None
        return k % max_outstanding >= num_micro_batches_with_partial_activation_checkpoints

    model_type = get_model_type(model)
    shape_kw = dict(tensor_shape=tensor_shape, decoder_sequence_length=decoder_sequence_length,
                    sequence_parallel_enabled=sequence_parallel_enabled)
    recv_shapes = get_tensor_shapes(rank - 1, model_type, **shape_kw)
    send_shapes = get_tensor_shapes(rank, model_type, **shape_kw)
    comm = dict(dtype=dtype, async_comm=async_comm, sequence_parallel_enabled=sequence_parallel_enabled,
                sync_batch_comm=sync_batch_comm)

    input_tensors: list[Any] = []
    output_tensors: list[Any] = []
    losses_reduced: list[Any] = []

    def fwd(k: int, input_tensor):
        return forward_step(forward_step_func, get_kth_microbatch(batch, k), model, input_tensor, losses_reduced,
                            dtype, disable_autocast, checkpoint_flag(k))

    def bwd(input_tensor, output_tensor, output_tensor_grad):
        return backward_step(input_tensor, output_tensor, output_tensor_grad, model_type=model_type,
                             grad_scaler=grad_scaler, deallocate_pipeline_outputs=deallocate_pipeline_outputs)

    # Warm-up: forwards only, filling the pipeline.
    for k in range(num_warmup):
        input_tensor = recv_forward(recv_shapes, **comm)
        output_tensor = fwd(k, input_tensor)
        send_forward(output_tensor, send_shapes, **comm)
        if not forward_only:
            input_tensors.append(input_tensor)
            output_tensors.append(output_tensor)
            free_output_tensor(output_tensor, deallocate_pipeline_outputs)

    # Steady state: one forward, one backward.
    if num_remaining > 0:
        input_tensor = recv_forward(recv_shapes, **comm)
    for i in range(num_remaining):
        last = i == num_remaining - 1
        output_tensor = fwd(i + num_warmup, input_tensor)
        if forward_only:
            send_forward(output_tensor, send_shapes, **comm)
            if not last:
                input_tensor = recv_forward(recv_shapes, **comm)
            continue
        output_tensor_grad = send_forward_recv_backward(output_tensor, send_shapes, **comm)
        input_tensors.append(input_tensor)
        output_tensors.append(output_tensor)
        free_output_tensor(output_tensor, deallocate_pipeline_outputs)
        input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
        input_tensor_grad = bwd(input_tensor, output_tensor, output_tensor_grad)
        if last:
            input_tensor = None
            send_backward(input_tensor_grad, recv_shapes, **comm)
        else:
            input_tensor = send_backward_recv_forward(input_tensor_grad, recv_shapes, **comm)

    # Cool-down: the outstanding backwards. As in Apex, only the first stage runs its last backward with
    # gradient sync enabled (its reduction overlaps the cool-down); every other stage leaves the no-sync
    # context after its last backward and reduces in the bubble (custom_grad_sync_func below).
    if not forward_only:
        for i in range(num_warmup):
            if i == num_warmup - 1 and rank == 0:
                grad_sync.enable()
            input_tensor, output_tensor = input_tensors.pop(0), output_tensors.pop(0)
            output_tensor_grad = recv_backward(send_shapes, **comm)
            input_tensor_grad = bwd(input_tensor, output_tensor, output_tensor_grad)
            send_backward(input_tensor_grad, recv_shapes, **comm)
    grad_sync.enable()
    if rank != 0 and custom_grad_sync_func is not None and not forward_only:
        custom_grad_sync_func()
    return losses_reduced
