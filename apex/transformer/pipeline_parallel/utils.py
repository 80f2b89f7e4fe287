"""Pipeline-parallel utilities: the global microbatch calculator NeMo/Megatron code reads, microbatch
slicing, loss averaging over the data-parallel group, and model helpers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from apex._errors import AssertRuntimeError, AssertValueError
from apex.transformer import parallel_state
from apex.transformer.enums import ModelType
from apex.transformer.microbatches import NumMicroBatchesCalculator, build_num_microbatches_calculator
from apex.transformer.pipeline_parallel._timers import _Timers
from apex.transformer.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate

# Upstream API: these are module-level singletons that Megatron-style training code queries by function.
_GLOBAL_NUM_MICROBATCHES_CALCULATOR: NumMicroBatchesCalculator | None = None
_GLOBAL_AUTORESUME = None
_GLOBAL_TIMERS: _Timers | None = None
# Declared by Apex (from Megatron-LM) and never set by it; kept for code that reads them.
_GLOBAL_ARGS = None
_GLOBAL_TOKENIZER = None
_GLOBAL_TENSORBOARD_WRITER = None

Shape = list[int] | torch.Size


def listify_model(model: torch.nn.Module | list[torch.nn.Module]) -> list[torch.nn.Module]:
    """``model`` if it is a list (virtual pipeline chunks), else ``[model]``."""
    return model if isinstance(model, list) else [model]


def _ensure_var_is_initialized(var, name: str) -> None:
    if var is None:
        raise AssertRuntimeError(f"{name} is not initialized.")


def _ensure_var_is_not_initialized(var, name: str) -> None:
    if var is not None:
        raise AssertRuntimeError(f"{name} is already initialized.")


def setup_microbatch_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """Create the global microbatch calculator (once; ``RuntimeError``, also the ``AssertionError`` Apex raised,
    if it already exists)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _ensure_var_is_not_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size
    )


def _reconfigure_microbatch_calculator(
    rank: int,
    rampup_batch_size: list[int] | None,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_size: int,
) -> None:
    """Replace the global microbatch calculator (tests and batch-size changes between runs)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size
    )


def _calculator() -> NumMicroBatchesCalculator:
    _ensure_var_is_initialized(_GLOBAL_NUM_MICROBATCHES_CALCULATOR, "num microbatches calculator")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_micro_batch_size() -> int:
    """The micro-batch size of the global microbatch calculator."""
    return _calculator().micro_batch_size


def get_num_microbatches() -> int:
    """The number of microbatches per global batch (changes during a batch-size ramp-up)."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """The current global batch size of the microbatch calculator."""
    return _calculator().get_current_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True) -> None:
    """Advance the microbatch calculator to ``consumed_samples`` (for batch-size ramp-up)."""
    _calculator().update(consumed_samples, consistency_check)


def _split_batch_into_microbatch(
    batch: list[torch.Tensor],
    *,
    _micro_batch_size: int | None = None,
    _global_batch_size: int | None = None,
) -> Iterator[list[torch.Tensor]]:
    micro = get_micro_batch_size() if _micro_batch_size is None else _micro_batch_size
    total = get_current_global_batch_size() if _global_batch_size is None else _global_batch_size
    for start in range(0, total, micro):
        yield [x[start:start + micro] for x in batch]


def get_kth_microbatch(batch: list[torch.Tensor] | None, k: int) -> list[torch.Tensor] | None:
    """Rows ``[k*mbs, (k+1)*mbs)`` of every tensor of a local minibatch (non-list batches pass through)."""
    if batch is None or not isinstance(batch, (list, tuple)):
        return batch
    micro_batch_size = get_micro_batch_size()
    start, end = k * micro_batch_size, (k + 1) * micro_batch_size
    microbatch = []
    for x in batch:
        if x.size(0) < end:
            raise AssertValueError(
                f"microbatch {k} needs rows [{start}, {end}) but a batch tensor has only {x.size(0)} rows"
            )
        microbatch.append(x[start:end])
    if not microbatch:
        raise AssertValueError("batch is an empty list")
    return microbatch


def get_autoresume():
    """Megatron's autoresume object, or None (not used here)."""
    return _GLOBAL_AUTORESUME


def _set_timers() -> None:
    global _GLOBAL_TIMERS
    _ensure_var_is_not_initialized(_GLOBAL_TIMERS, "timers")
    _GLOBAL_TIMERS = _Timers()


def get_timers() -> _Timers:
    """The global timers; ``RuntimeError`` before ``setup_microbatch_calculator``/``_set_timers``."""
    _ensure_var_is_initialized(_GLOBAL_TIMERS, "timers")
    return _GLOBAL_TIMERS


def print_rank_0(message: str) -> None:
    """Print ``message`` on global rank 0 only (everywhere when torch.distributed is not initialized)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def is_last_rank() -> bool:
    """True on the last global rank."""
    return torch.distributed.get_rank() == torch.distributed.get_world_size() - 1


def print_rank_last(message: str) -> None:
    """Print ``message`` on the last global rank only."""
    if not torch.distributed.is_initialized() or is_last_rank():
        print(message, flush=True)


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """True unless the parameter is marked ``shared`` (Megatron's semantics; upstream apex inverted it)."""
    return not getattr(param, "shared", False)


def unwrap_model(model, module_instances=(DistributedDataParallel,)):
    """Strip wrappers (DDP by default) from a module or each module of a list."""
    models = listify_model(model)
    unwrapped = []
    for m in models:
        while isinstance(m, module_instances):
            m = m.module
        unwrapped.append(m)
    return unwrapped if isinstance(model, list) else unwrapped[0]


def get_model_type(model: torch.nn.Module) -> ModelType:
    """``model.model_type`` of the unwrapped model, ``ModelType.encoder_or_decoder`` when absent."""
    return getattr(unwrap_model(model), "model_type", ModelType.encoder_or_decoder)


def calc_params_l2_norm(model: torch.nn.Module | list[torch.nn.Module], bf16: bool) -> float:
    """L2 norm of all parameters over the model-parallel group, counting shared and TP-duplicated ones once.

    Accumulates in float32 (``bf16`` upcasts bf16 parameters, as upstream) — float64 for float64 params.
    """
    squares = []
    distributed = parallel_state.model_parallel_is_initialized()
    for module in listify_model(model):
        for param in module.parameters():
            if param_is_not_shared(param) and (not distributed or param_is_not_tensor_parallel_duplicate(param)):
                data = param.detach()
                if bf16 or data.dtype in (torch.float16, torch.bfloat16):
                    data = data.float()
                squares.append(torch.linalg.vector_norm(data).square())
    norm_2 = torch.stack(squares).sum() if squares else torch.zeros(())
    norm_2 = norm_2.float() if norm_2.dtype != torch.float64 else norm_2
    if distributed:
        torch.distributed.all_reduce(norm_2, group=parallel_state.get_model_parallel_group())
    return norm_2.item() ** 0.5


def average_losses_across_data_parallel_group(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean over the data-parallel group of each (scalar) loss, as one 1-D tensor."""
    averaged = torch.cat([loss.clone().detach().view(1) for loss in losses])
    group = parallel_state.get_data_parallel_group()
    torch.distributed.all_reduce(averaged, group=group)
    return averaged / torch.distributed.get_world_size(group=group)


def report_memory(name: str) -> None:
    """Print the CUDA memory counters prefixed by ``name`` (does nothing without CUDA)."""
    if not torch.cuda.is_available():
        return
    mb = 1024.0 * 1024.0
    string = (
        f"{name} memory (MB) | allocated: {torch.cuda.memory_allocated() / mb}"
        f" | max allocated: {torch.cuda.max_memory_allocated() / mb}"
        f" | reserved: {torch.cuda.memory_reserved() / mb} | max reserved: {torch.cuda.max_memory_reserved() / mb}"
    )
    if parallel_state.get_data_parallel_rank() == 0:
        print(f"[Rank {torch.distributed.get_rank()}] {string}", flush=True)


def print_params_min_max_norm(optimizer, iteration: int) -> None:
    """Print the minimum, maximum and norm of every parameter of ``optimizer`` (Megatron's wrapper, whose
    ``.optimizer`` holds the param groups, or a plain ``torch.optim.Optimizer``), one line per parameter:
    iteration, rank, index, whether it is tensor-model-parallel, min, max, norm."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    lines = ["iteration, rank, index, tensor-model-parallel, min, max, norm\n"]
    index = 0
    groups = getattr(getattr(optimizer, "optimizer", optimizer), "param_groups", None)
    if groups is None:  # AttributeError, as Apex's (it read optimizer.optimizer.param_groups)
        raise AttributeError("print_params_min_max_norm: optimizer must be a torch.optim.Optimizer or a wrapper "
                             f"holding one in .optimizer, got {type(optimizer).__name__}")
    for group in groups:
        for param in group["params"]:
            index += 1
            data = param.detach()
            tp = int(getattr(param, "tensor_model_parallel", False))
            lines.append(f"{iteration:7d}, {rank:4d}, {index:4d}, {tp:2d}, "
                         f"{data.min():.6E}, {data.max():.6E}, {torch.linalg.norm(data):.6E}\n")
    print("".join(lines), flush=True)


def get_ltor_masks_and_position_ids(
    data: torch.Tensor, eod_token: int, reset_position_ids: bool, reset_attention_mask: bool, eod_mask_loss: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal mask (True = masked), loss mask and position ids for a ``[batch, seq]`` token tensor."""
    micro_batch_size, seq_length = data.size()
    att_batch = micro_batch_size if reset_attention_mask else 1
    attention_mask = torch.tril(torch.ones((att_batch, seq_length, seq_length), device=data.device)).view(
        att_batch, 1, seq_length, seq_length
    )
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device).unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()
    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):  # documents per row differ, so rows are handled one by one
            eod_index = (data[b] == eod_token).nonzero().flatten().tolist()
            prev = 0
            for i in eod_index:
                if reset_attention_mask:
                    attention_mask[b, 0, i + 1:, : i + 1] = 0
                if reset_position_ids:
                    position_ids[b, i + 1:] -= i + 1 - prev
                    prev = i + 1
    return attention_mask < 0.5, loss_mask, position_ids
