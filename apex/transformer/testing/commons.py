"""Shared helpers of apex.transformer's tests: toy models for the schedules, seeding, process-group setup."""

from __future__ import annotations

import datetime
import os
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy
import torch
import torch.nn as nn

from apex.transformer._ucc_util import HAS_UCC
from apex.transformer.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    model_parallel_cuda_manual_seed,
    scatter_to_sequence_parallel_region,
)

TEST_SUCCESS_MESSAGE = ">> passed the test :-)"


def _average_losses(losses):
    # Imported at call time: pipeline_parallel sits beside this module and builds on tensor_parallel.
    from apex.transformer.pipeline_parallel.utils import average_losses_across_data_parallel_group
    return average_losses_across_data_parallel_group(losses)


class MyLayer(nn.Module):
    def __init__(self, hidden_size: int, pre_process: bool, post_process: bool):
        super().__init__()
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer = nn.Linear(hidden_size, hidden_size)

    def forward(self, x):
        return self.layer(x)


class _InputTensorMixin:
    input_tensor = None

    def set_input_tensor(self, input_tensor) -> None:
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        self.input_tensor = input_tensor[0]


class MyModel(_InputTensorMixin, nn.Module):
    def __init__(self, hidden_size: int, pre_process: bool = False, post_process: bool = False, *,
                 add_encoder: bool = False, add_decoder: bool = False) -> None:
        super().__init__()
        self.pre_process = pre_process
        self.post_process = post_process
        self.layer = MyLayer(hidden_size=hidden_size, pre_process=pre_process, post_process=post_process)
        self.input_tensor = None

    def forward(self, x):
        return self.layer(x if self.input_tensor is None else self.input_tensor)


class ToyParallelMLP(_InputTensorMixin, nn.Module):
    """h -> 4h (column parallel, GELU) -> h (row parallel)."""

    def __init__(self, hidden_size: int, pre_process: bool = False, post_process: bool = False, *,
                 sequence_parallel_enabled: bool = False, add_encoder: bool = False, add_decoder: bool = False):
        super().__init__()
        self.pre_process = pre_process
        self.post_process = post_process
        self.sequence_parallel_enabled = sequence_parallel_enabled
        ffn_hidden_size = 4 * hidden_size
        self.dense_h_to_4h = ColumnParallelLinear(
            hidden_size, ffn_hidden_size, gather_output=False, skip_bias_add=True, bias=True,
            sequence_parallel_enabled=sequence_parallel_enabled, no_async_tensor_model_parallel_allreduce=True)
        self.dense_4h_to_h = RowParallelLinear(
            ffn_hidden_size, hidden_size, input_is_parallel=True, skip_bias_add=False, bias=True,
            sequence_parallel_enabled=sequence_parallel_enabled)
        self.activation_func = torch.nn.GELU()
        self.input_tensor = None

    def forward(self, x):
        input = x if self.input_tensor is None else self.input_tensor
        intermediate_parallel, bias_parallel = self.dense_h_to_4h(input)
        if bias_parallel is not None:
            intermediate_parallel = intermediate_parallel + bias_parallel
        output, _ = self.dense_4h_to_h(self.activation_func(intermediate_parallel))
        return output


def model_provider_func(hidden_size: int, pre_process: bool, post_process: bool, *, add_encoder: bool = False,
                        add_decoder: bool = False) -> MyModel:
    """Build the toy :class:`MyModel` used by upstream's pipeline tests."""
    return MyModel(hidden_size, pre_process, post_process, add_encoder=add_encoder, add_decoder=add_decoder)


def mlp_provider_func(hidden_size: int, pre_process: bool, post_process: bool, *, add_encoder: bool = False,
                      add_decoder: bool = False, sequence_parallel_enabled: bool = False) -> ToyParallelMLP:
    """Build the toy :class:`ToyParallelMLP` used by upstream's pipeline tests."""
    return ToyParallelMLP(hidden_size, pre_process, post_process, add_encoder=add_encoder, add_decoder=add_decoder,
                          sequence_parallel_enabled=sequence_parallel_enabled)


def process_batch(batch):
    """The first element of a list batch, or the batch itself."""
    return batch[0] if isinstance(batch, list) else batch


def _sum_loss(x):
    loss = torch.sum(x)
    return loss, {"avg": _average_losses([loss])}


def fwd_step_func(batch, model):
    """A pipeline ``forward_step_func``: ``(model(batch), loss_func)`` with a summed loss."""
    return model(process_batch(batch)), _sum_loss


@dataclass(frozen=True)
class ToyParallelMLPFwdBwdStepFunc:
    sequence_parallel_enabled: bool

    def __call__(self, batch, model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        x = batch[0] if isinstance(batch, list) else batch
        if isinstance(x, torch.Tensor):
            x = x.transpose(0, 1).contiguous()
            if self.sequence_parallel_enabled:
                x = scatter_to_sequence_parallel_region(x)
        return model(x), _sum_loss


class IdentityLayer(torch.nn.Module):
    def __init__(self, size, scale=1.0):
        super().__init__()
        self.weight = torch.nn.Parameter(scale * torch.randn(size))

    def forward(self):
        return self.weight


def set_random_seed(seed: int) -> None:
    """Seed Python, NumPy, torch and the model-parallel RNG tracker."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def initialize_distributed(backend: str = "nccl") -> None:
    """``init_process_group`` from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; NCCL without CUDA means Gloo."""
    if backend not in ("nccl", "ucc", "gloo"):
        raise RuntimeError(f"Currently only nccl, ucc & gloo are supported but {backend}")
    if backend == "ucc" and not HAS_UCC:
        raise ImportError("UCC backend requires pytorch source build with UCC installed and enabled")
    from apex.transformer.testing import global_vars

    args = global_vars.get_args() if global_vars._GLOBALS.args is not None else None
    local_rank = getattr(args, "local_rank", None)
    rank = int(os.getenv("RANK", "0"))
    world_size = int(os.getenv("WORLD_SIZE", "1"))
    print(f"> initializing torch.distributed with local rank: {local_rank}, rank: {rank}, world size: {world_size}")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank if local_rank is not None else rank % torch.cuda.device_count())
    elif backend in ("nccl", "ucc"):
        backend = "gloo"
    init_method = f"tcp://{os.getenv('MASTER_ADDR', 'localhost')}:{os.getenv('MASTER_PORT', '6000')}"
    torch.distributed.init_process_group(backend=backend, world_size=world_size, rank=rank, init_method=init_method,
                                         timeout=datetime.timedelta(seconds=60))


def print_separator(message: str) -> None:
    """Print ``message`` between dashes on rank 0."""
    filler = "-" * ((78 - len(message)) // 2)
    if torch.distributed.get_rank() == 0:
        print(f"\n{filler} {message} {filler}", flush=True)
