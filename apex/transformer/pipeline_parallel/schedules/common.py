"""Building blocks shared by the pipeline schedules.

Contract: ``forward_step_func(batch, model) -> (output, loss_func)``; the model exposes
``set_input_tensor(list)`` (the activation received from the previous stage, None on the first stage);
on the last stage ``loss_func(output) -> (loss, loss_reduced)`` and the schedule back-propagates
``loss / num_microbatches``, so gradients are those of the mean loss over the global batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.variable import Variable

from apex._errors import AssertTypeError, AssertValueError
from apex.normalization.fused_layer_norm import FusedLayerNorm
from apex.transformer import parallel_state
from apex.transformer.enums import ModelType
from apex.transformer.log_util import get_transformer_logger
from apex.transformer.pipeline_parallel.p2p_communication import FutureTensor
from apex.transformer.pipeline_parallel.utils import get_model_type, get_num_microbatches, listify_model, unwrap_model
from apex.transformer.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes

_logger = get_transformer_logger(__name__)

Batch = torch.Tensor | FutureTensor | list[torch.Tensor | FutureTensor] | tuple[torch.Tensor | FutureTensor, ...]
LossFunc = Callable[[torch.Tensor], torch.Tensor]
FwdStepFunc = Callable[[Batch | None, torch.nn.Module], tuple[torch.Tensor, LossFunc]]

__all__ = [
    "build_model",
    "forward_step",
    "backward_step",
    "free_output_tensor",
    "custom_backward",
    "listify_model",
    "_get_params_for_weight_decay_optimization",
]


def build_model(
    model_provider_func: Callable[..., torch.nn.Module],
    wrap_with_ddp: bool = True,
    virtual_pipeline_model_parallel_size: int | None = None,
    model_type: ModelType = ModelType.encoder_or_decoder,
    *args: Any,
    **kwargs: Any,
) -> list[torch.nn.Module]:
    """Instantiate this rank's stage(s): ``model_provider_func(*args, pre_process=..., post_process=..., **kwargs)``
    (plus ``add_encoder``/``add_decoder`` for encoder-and-decoder models), one module per virtual stage.

    Moves the modules to the current CUDA device when CUDA is available, and wraps them in
    DistributedDataParallel over the data-parallel group when ``wrap_with_ddp``. Returns a list.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() > 1 and virtual_pipeline_model_parallel_size is not None:
        model = []
        for i in range(virtual_pipeline_model_parallel_size):
            parallel_state.set_virtual_pipeline_model_parallel_rank(i)
            stage_kwargs = dict(kwargs, pre_process=parallel_state.is_pipeline_first_stage(),
                                post_process=parallel_state.is_pipeline_last_stage())
            this_model = model_provider_func(*args, **stage_kwargs)
            this_model.model_type = model_type
            model.append(this_model)
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)
    else:
        pre_process = parallel_state.is_pipeline_first_stage()
        post_process = parallel_state.is_pipeline_last_stage()
        stage_kwargs = dict(kwargs)
        if model_type == ModelType.encoder_and_decoder:
            add_encoder, add_decoder = True, True
            world_size = parallel_state.get_pipeline_model_parallel_world_size()
            if world_size > 1:
                split_rank = parallel_state.get_pipeline_model_parallel_split_rank()
                if split_rank is None:
                    raise RuntimeError("Split rank needs to be specified for model with both encoder and decoder.")
                rank = parallel_state.get_pipeline_model_parallel_rank()
                pre_process = rank in (0, split_rank)
                post_process = rank in (split_rank - 1, world_size - 1)
                add_encoder = parallel_state.is_pipeline_stage_before_split()
                add_decoder = parallel_state.is_pipeline_stage_after_split()
            stage_kwargs.update(add_encoder=add_encoder, add_decoder=add_decoder)
        elif model_type != ModelType.encoder_or_decoder:
            raise ValueError(f"model_type must be a ModelType, got {model_type!r}")
        stage_kwargs.update(pre_process=pre_process, post_process=post_process)
        model = model_provider_func(*args, **stage_kwargs)
        model.model_type = model_type
    model = listify_model(model)
    for module in model:
        for param in module.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    if torch.cuda.is_available():
        model = [m.cuda(torch.cuda.current_device()) for m in model]
    if wrap_with_ddp:
        device_ids = [torch.cuda.current_device()] if torch.cuda.is_available() else None
        model = [
            torch.nn.parallel.DistributedDataParallel(
                m, device_ids=device_ids, output_device=device_ids[0] if device_ids else None,
                process_group=parallel_state.get_data_parallel_group(),
            )
            for m in model
        ]
    return model


def _calc_number_of_params(model: list[torch.nn.Module]) -> int:
    return sum(p.nelement() for m in model for p in m.parameters())


def _get_params_for_weight_decay_optimization(
    model: torch.nn.Module | list[torch.nn.Module],
    *,
    no_weight_decay_modules=(FusedLayerNorm,),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two optimizer param groups: weights (decayed) and biases plus ``no_weight_decay_modules``' params
    (``weight_decay=0``)."""
    decay: dict[str, Any] = {"params": []}
    no_decay: dict[str, Any] = {"params": [], "weight_decay": 0.0}
    for module in listify_model(model):
        for sub in module.modules():
            own = [(n, p) for n, p in sub._parameters.items() if p is not None]
            if isinstance(sub, no_weight_decay_modules):
                no_decay["params"].extend(p for _, p in own)
            else:
                decay["params"].extend(p for n, p in own if n != "bias")
                no_decay["params"].extend(p for n, p in own if n == "bias")
    return decay, no_decay


def free_output_tensor(
    output_tensors: torch.Tensor | Sequence[torch.Tensor] | None,
    deallocate_pipeline_outputs: bool = False,
) -> None:
    """Replace the ``.data`` of already-sent outputs by a 1-element tensor (only ``grad_fn`` is still needed);
    :func:`custom_backward` can then back-propagate through them."""
    if not deallocate_pipeline_outputs or output_tensors is None:
        return
    if isinstance(output_tensors, torch.Tensor):
        output_tensors = [output_tensors]
    for out in output_tensors:
        if out is not None:
            out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Run the autograd engine directly: unlike ``torch.autograd.backward`` it does not check that
    ``grad_output`` has the (pseudo-freed) output's shape."""
    if not isinstance(output, torch.Tensor):
        raise AssertTypeError(f"output must be a torch.Tensor, got {type(output).__name__}")
    if grad_output is not None and not isinstance(grad_output, torch.Tensor):
        raise AssertTypeError(f"grad_output must be a torch.Tensor or None, got {type(grad_output).__name__}")
    if output.numel() != 1:
        raise AssertValueError("output should be pseudo-freed (1 element) before custom_backward")
    if grad_output is None:
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,), grad_tensors=(grad_output,), keep_graph=False, create_graph=False,
        inputs=(), allow_unreachable=True, accumulate_grad=True,
    )


def _get(x):
    return x.get() if isinstance(x, FutureTensor) else x


def forward_step(
    forward_step_func: FwdStepFunc,
    batch: Batch | None,
    model: torch.nn.Module,
    input_tensor: torch.Tensor | list[torch.Tensor] | None,
    losses_reduced: list[torch.Tensor],
    dtype: torch.dtype,
    disable_autocast: bool = False,
    checkpoint_activations_micro_batch: bool | None = None,
) -> torch.Tensor | Sequence[torch.Tensor]:
    """One microbatch through this stage; on the last stage returns ``loss / num_microbatches`` and appends
    ``loss_reduced`` to ``losses_reduced``. Autocast runs when ``dtype`` is fp16/bf16 and not disabled."""
    unwrapped_model = unwrap_model(model)
    if not hasattr(unwrapped_model, "set_input_tensor"):
        raise TypeError(
            f"pipeline schedules need a model with set_input_tensor(input_tensor); {type(unwrapped_model).__name__} "
            "has none"
        )
    model_type = get_model_type(unwrapped_model)
    unwrap_output_tensor = not isinstance(input_tensor, list)
    if unwrap_output_tensor:
        input_tensor = [input_tensor]
    input_tensor = [_get(t) for t in input_tensor]
    unwrapped_model.set_input_tensor(input_tensor)
    use_autocast = not disable_autocast and dtype in (torch.half, torch.bfloat16)
    ctx = torch.autocast("cuda" if torch.cuda.is_available() else "cpu", dtype=dtype) if use_autocast \
        else contextlib.nullcontext()
    with ctx:
        if checkpoint_activations_micro_batch is None:
            output_tensor, loss_func = forward_step_func(batch, model)
        else:
            output_tensor, loss_func = forward_step_func(batch, model, checkpoint_activations_micro_batch)
        if parallel_state.is_pipeline_last_stage():
            loss, loss_reduced = loss_func(output_tensor)
            output_tensor = loss / get_num_microbatches()
            losses_reduced.append(loss_reduced)
    if parallel_state.is_pipeline_stage_after_split() and model_type == ModelType.encoder_and_decoder:
        return [output_tensor, input_tensor[-1]]
    return output_tensor if unwrap_output_tensor else [output_tensor]


def backward_step(
    input_tensor: torch.Tensor | None,
    output_tensor: torch.Tensor,
    output_tensor_grad: torch.Tensor | None,
    model_type: ModelType,
    *,
    grad_scaler: Any | None = None,
    deallocate_pipeline_outputs: bool = False,
) -> None | torch.Tensor | Sequence[torch.Tensor]:
    """Back-propagate ``output_tensor_grad`` (the loss itself on the last stage, scaled by ``grad_scaler``)
    and return the gradient of the stage's input (None on the first stage)."""
    unwrap_input_tensor_grad = not isinstance(input_tensor, list)
    if unwrap_input_tensor_grad:
        input_tensor = [input_tensor]
    input_tensor = [_get(t) for t in input_tensor]
    for x in input_tensor:
        if x is not None:
            x.retain_grad()
    output_tensor = [_get(t) for t in (output_tensor if isinstance(output_tensor, list) else [output_tensor])]
    output_tensor_grad = [
        _get(t) for t in (output_tensor_grad if isinstance(output_tensor_grad, list) else [output_tensor_grad])
    ]
    if grad_scaler is not None and output_tensor_grad[0] is None:
        output_tensor[0] = grad_scaler.scale(output_tensor[0])
    if deallocate_pipeline_outputs:
        custom_backward(output_tensor[0], output_tensor_grad[0])
    else:
        torch.autograd.backward(output_tensor[0], grad_tensors=output_tensor_grad[0])
    input_tensor_grad = [None if x is None else x.grad for x in input_tensor]
    if (
        parallel_state.get_pipeline_model_parallel_world_size() > 1
        and parallel_state.is_pipeline_stage_after_split()
        and model_type == ModelType.encoder_and_decoder
        and len(output_tensor_grad) > 1
        and output_tensor_grad[1] is not None
    ):
        input_tensor_grad[-1].add_(output_tensor_grad[1])
    return input_tensor_grad[0] if unwrap_input_tensor_grad else input_tensor_grad


class GradSync:
    """Gradient synchronisation off until the last backward: ``custom_sync_context_handler`` (or a null
    context) entered by :meth:`disable` and left by :meth:`enable`, each idempotent."""

    def __init__(self, custom_sync_context_handler: Callable | None) -> None:
        no_handler = custom_sync_context_handler is None
        self._handler = contextlib.nullcontext if no_handler else custom_sync_context_handler
        self._context = None

    def disable(self) -> None:
        if self._context is None:
            self._context = self._handler()
            self._context.__enter__()

    def enable(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None
