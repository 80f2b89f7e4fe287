"""Tensor-parallel layers: :class:`VocabParallelEmbedding`, :class:`ColumnParallelLinear` (output
features split over the tensor group) and :class:`RowParallelLinear` (input features split).

Weights are stored as ``nn.Linear`` does (``[out, in]``) and are ``params_dtype``; inputs are
``[sequence, batch, hidden]``. ``use_cpu_initialization`` builds the full master weight with the
default generator and keeps this rank's slice (identical to an unsharded layer seeded the same way);
otherwise each rank initialises its slice inside the RNG tracker's model-parallel fork.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch.nn.parameter import Parameter

from apex._errors import AssertRuntimeError
from apex.transformer.log_util import get_transformer_logger
from apex.transformer.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from apex.transformer.tensor_parallel._linear import (
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_grad_accumulation_and_async_allreduce,
)
from apex.transformer.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from apex.transformer.tensor_parallel.random import get_cuda_rng_tracker
from apex.transformer.tensor_parallel.utils import VocabUtility
from apex.transformer.utils import _current_device, divide

__all__ = [
    "ColumnParallelLinear",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_tensor_model_parallel_attributes",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]

_logger = get_transformer_logger(__name__)

# The weight-gradient accumulation lives in apex.transformer.functional and is always available.
_grad_accum_fusion_available = True

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for a sharded parameter, or for a replicated one on tensor-parallel rank 0 (so each
    parameter is counted once, e.g. in a gradient norm)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or get_tensor_model_parallel_rank() == 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark ``tensor`` as split (``is_parallel``) along ``dim`` with ``stride``; ``RuntimeError`` (also the
    ``AssertionError`` Apex raised) if already marked."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(tensor, attribute):
            raise AssertRuntimeError(f"tensor already has the tensor-parallel attribute {attribute!r}")
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the default (not split) tensor-parallel attributes where it has none."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    """Copy the tensor-parallel attributes of ``source_tensor`` to ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def _initialize_affine_weight_gpu(weight, init_method, partition_dim, stride=1):
    """Initialise this rank's slice in place, inside the tracker's model-parallel fork of the accelerator's
    generator. As in Apex, that fork leaves the CPU generator alone: a CPU tensor passed here draws from the
    default CPU generator (upstream's tests rely on it), also on a machine without an accelerator, where the
    tracker drives the CPU generator. The layers' own CPU parameters take the fork there:
    :func:`_initialize_affine_weight_on_device`."""
    set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)
    if weight.device.type == "cpu":
        init_method(weight)
        return
    with get_cuda_rng_tracker().fork():
        init_method(weight)


def _initialize_affine_weight_on_device(weight, init_method, partition_dim, stride=1):
    """The layers' ``use_cpu_initialization=False`` path: the slice drawn inside the tracker's fork on any
    device, so that on a machine without an accelerator (parameters on the CPU, the tracker forking the CPU
    generator) every tensor-parallel rank still draws its own slice, as on GPUs."""
    set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)
    with get_cuda_rng_tracker().fork():
        init_method(weight)


def _initialize_affine_weight_cpu(weight, output_size, input_size, per_partition_size, partition_dim, init_method,
                                  stride=1, return_master_weight=False, *, params_dtype=torch.float32):
    """Initialise the full ``[output_size, input_size]`` fp32 master weight and copy this rank's slices
    (``stride`` interleaved chunks along ``partition_dim``) into ``weight``."""
    set_tensor_model_parallel_attributes(tensor=weight, is_parallel=True, dim=partition_dim, stride=stride)
    master_weight = torch.empty(output_size, input_size, dtype=torch.float, requires_grad=False)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=params_dtype)
    chunks = torch.split(master_weight, divide(per_partition_size, stride), dim=partition_dim)
    mine = chunks[get_tensor_model_parallel_rank()::get_tensor_model_parallel_world_size()]
    with torch.no_grad():
        weight.copy_(torch.cat(mine, dim=partition_dim))
    return master_weight if return_master_weight else None


class VocabParallelEmbedding(torch.nn.Module):
    """``nn.Embedding`` whose rows (the vocabulary) are split over the tensor group; ids outside this
    rank's range give zeros, and the all-reduce sums the one rank that owns each id."""

    def __init__(self, num_embeddings: int, embedding_dim: int, init_method=init.xavier_normal_, *,
                 params_dtype: torch.dtype = torch.float32, use_cpu_initialization: bool = False):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = None
        self.max_norm = None
        self.norm_type = 2.0
        self.scale_grad_by_freq = False
        self.sparse = False
        self._weight = None
        self.tensor_model_parallel_size = get_tensor_model_parallel_world_size()
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, get_tensor_model_parallel_rank(), self.tensor_model_parallel_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        device = None if use_cpu_initialization else _current_device()
        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, device=device,
                                            dtype=params_dtype))
        if use_cpu_initialization:
            _initialize_affine_weight_cpu(self.weight, num_embeddings, embedding_dim, self.num_embeddings_per_partition,
                                          0, init_method, params_dtype=params_dtype)
        else:
            _initialize_affine_weight_on_device(self.weight, init_method, partition_dim=0, stride=1)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tensor_model_parallel_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = (input_ - self.vocab_start_index).masked_fill(input_mask, 0)
        else:
            masked_input = input_
        output_parallel = F.embedding(masked_input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                                      self.scale_grad_by_freq, self.sparse)
        if self.tensor_model_parallel_size > 1:
            output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel)


def _new_param(shape, params_dtype, on_cpu: bool) -> Parameter:
    return Parameter(torch.empty(*shape, dtype=params_dtype, device=None if on_cpu else _current_device()))


class ColumnParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A``'s rows (output features) split over the tensor group: rank ``r`` holds
    ``A_r`` of shape ``[output_size / T, input_size]``. ``forward`` returns ``(output, bias)``; the bias is
    returned instead of added with ``skip_bias_add``. ``gather_output`` all-gathers the output features.
    The input gradient's all-reduce runs asynchronously beside the weight-gradient GEMM unless
    ``no_async_tensor_model_parallel_allreduce``; with ``sequence_parallel_enabled`` the input is this
    rank's sequence chunk and is all-gathered (incompatible with the asynchronous all-reduce)."""

    def __init__(self, input_size, output_size, bias=True, gather_output=True, init_method=init.xavier_normal_,
                 stride=1, keep_master_weight_for_test=False, skip_bias_add=False, *,
                 no_async_tensor_model_parallel_allreduce=False, params_dtype=torch.float32,
                 use_cpu_initialization=False, gradient_accumulation_fusion=False,
                 sequence_parallel_enabled: bool = False, accumulation_in_fp16: bool | None = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        world_size = get_tensor_model_parallel_world_size()
        self.output_size_per_partition = divide(output_size, world_size)
        self.skip_bias_add = skip_bias_add
        if accumulation_in_fp16 is not None:
            warnings.warn(f"Deprecated option `accumulation_in_fp16` is set to {accumulation_in_fp16}", stacklevel=2)
        self.async_tensor_model_parallel_allreduce = not no_async_tensor_model_parallel_allreduce and world_size > 1
        if sequence_parallel_enabled and world_size <= 1:
            warnings.warn(f"`sequence_parallel_enabled` is set to `True`, but got world_size of {world_size}",
                          stacklevel=2)
        if self.async_tensor_model_parallel_allreduce and sequence_parallel_enabled:
            raise RuntimeError("`async_tensor_model_parallel_allreduce` and `sequence_parallel_enabled` cannot be "
                               "enabled at the same time.")
        if sequence_parallel_enabled and gather_output:  # Apex asserts this in forward
            raise AssertRuntimeError("`gather_output` must be False when `sequence_parallel_enabled` is True")
        self.sequence_parallel_enabled = sequence_parallel_enabled
        self.gradient_accumulation_fusion = gradient_accumulation_fusion

        self.weight = _new_param((self.output_size_per_partition, input_size), params_dtype, use_cpu_initialization)
        if use_cpu_initialization:
            self.master_weight = _initialize_affine_weight_cpu(
                self.weight, output_size, input_size, self.output_size_per_partition, 0, init_method, stride=stride,
                return_master_weight=keep_master_weight_for_test, params_dtype=params_dtype)
        else:
            _initialize_affine_weight_on_device(self.weight, init_method, partition_dim=0, stride=stride)
        if bias:
            self.bias = _new_param((self.output_size_per_partition,), params_dtype, use_cpu_initialization)
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            with torch.no_grad():
                self.bias.zero_()
        else:
            self.register_parameter("bias", None)
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = self.bias if not self.skip_bias_add else None
        if self.async_tensor_model_parallel_allreduce or self.sequence_parallel_enabled:
            input_parallel = input_  # the linear function does the communication itself
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_)
        output_parallel = self._forward_impl(
            input=input_parallel, weight=self.weight, bias=bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            async_grad_allreduce=self.async_tensor_model_parallel_allreduce,
            sequence_parallel_enabled=self.sequence_parallel_enabled)
        output = gather_from_tensor_model_parallel_region(output_parallel) if self.gather_output else output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(torch.nn.Module):
    """``Y = X A^T + b`` with ``A``'s columns (input features) split over the tensor group: rank ``r``
    holds ``A_r`` of shape ``[output_size, input_size / T]`` and computes ``X_r A_r^T``; the partial
    products are all-reduced (reduce-scattered along the sequence with ``sequence_parallel_enabled``,
    which needs ``input_is_parallel``). The bias is not split and is added after the reduction."""

    def __init__(self, input_size, output_size, bias=True, input_is_parallel=False, init_method=init.xavier_normal_,
                 stride=1, keep_master_weight_for_test=False, skip_bias_add=False, *, params_dtype=torch.float32,
                 use_cpu_initialization=False, gradient_accumulation_fusion=False,
                 sequence_parallel_enabled: bool = False, accumulation_in_fp16: bool | None = None):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.input_size_per_partition = divide(input_size, get_tensor_model_parallel_world_size())
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        self.sequence_parallel_enabled = sequence_parallel_enabled
        if sequence_parallel_enabled and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel_enabled`, `input_is_parallel` must be `True`")
        if accumulation_in_fp16 is not None:
            warnings.warn(f"Deprecated option `accumulation_in_fp16` is set to {accumulation_in_fp16}", stacklevel=2)

        self.weight = _new_param((output_size, self.input_size_per_partition), params_dtype, use_cpu_initialization)
        if use_cpu_initialization:
            self.master_weight = _initialize_affine_weight_cpu(
                self.weight, output_size, input_size, self.input_size_per_partition, 1, init_method, stride=stride,
                return_master_weight=keep_master_weight_for_test, params_dtype=params_dtype)
        else:
            _initialize_affine_weight_on_device(self.weight, init_method, partition_dim=1, stride=stride)
        if bias:
            self.bias = _new_param((output_size,), params_dtype, use_cpu_initialization)
            with torch.no_grad():
                self.bias.zero_()
            self.bias.sequence_parallel_enabled = sequence_parallel_enabled
        else:
            self.register_parameter("bias", None)
        self._forward_impl = linear_with_grad_accumulation_and_async_allreduce

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_parallel = input_ if self.input_is_parallel else scatter_to_tensor_model_parallel_region(input_)
        output_parallel = self._forward_impl(
            input=input_parallel, weight=self.weight, bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            async_grad_allreduce=False, sequence_parallel_enabled=False)
        if self.sequence_parallel_enabled:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel)
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel)
        if self.skip_bias_add:
            return output_, self.bias
        return (output_ + self.bias if self.bias is not None else output_), None
