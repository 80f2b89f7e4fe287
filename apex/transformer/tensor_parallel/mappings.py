"""Communication at the borders of tensor-parallel regions, as autograd Functions.

Each mapping's backward is the adjoint of its forward: copy <-> all-reduce, split <-> all-gather (last
dimension for tensor parallelism, first dimension for sequence parallelism), reduce-scatter <->
all-gather. With a tensor-parallel world of one they are all identities.
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
from apex.transformer.tensor_parallel.utils import split_tensor_along_last_dim

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]


def _reduce(input_: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) ``input_`` in place over the tensor-parallel group and return it."""
    if get_tensor_model_parallel_world_size() == 1:
        return input_
    dist.all_reduce(input_, group=get_tensor_model_parallel_group())
    return input_


def _split_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of the last dimension (contiguous)."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    return split_tensor_along_last_dim(input_, world_size)[get_tensor_model_parallel_rank()].contiguous()


def _split_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """This rank's chunk of the first (sequence) dimension (contiguous)."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    if input_.size(0) % world_size:
        raise AssertValueError(f"first dimension {input_.size(0)} is not divisible by the tensor parallel size "
                               f"{world_size}")
    size = input_.size(0) // world_size
    return input_[get_tensor_model_parallel_rank() * size:][:size].contiguous()


def _gather_along_last_dim(input_: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' tensors along the last dimension."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    input_ = input_.contiguous()
    chunks = [torch.empty_like(input_) for _ in range(world_size)]
    chunks[get_tensor_model_parallel_rank()] = input_
    dist.all_gather(chunks, input_, group=get_tensor_model_parallel_group())
    return torch.cat(chunks, dim=-1)


def _gather_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Concatenate the ranks' tensors along the first dimension (one all_gather_into_tensor)."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    output = input_.new_empty((input_.size(0) * world_size, *input_.shape[1:]))
    dist.all_gather_into_tensor(output, input_.contiguous(), group=get_tensor_model_parallel_group())
    return output


def _reduce_scatter_along_first_dim(input_: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks and keep this rank's chunk of the first dimension."""
    world_size = get_tensor_model_parallel_world_size()
    if world_size == 1:
        return input_
    if input_.size(0) % world_size:
        raise AssertValueError(f"first dimension {input_.size(0)} is not divisible by the tensor parallel size "
                               f"{world_size}")
    output = input_.new_empty((input_.size(0) // world_size, *input_.shape[1:]))
    dist.reduce_scatter_tensor(output, input_.contiguous(), group=get_tensor_model_parallel_group())
    return output


class _CopyToModelParallelRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient."""

    @staticmethod
    def symbolic(graph, input_):
        return input_

    @staticmethod
    def forward(ctx, input_):
        return input_

    @staticmethod
    def backward(ctx, grad_output):
        # The engine may hand the same gradient tensor to several nodes (``a + b``): reduce a copy.
        return _reduce(grad_output.clone())


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def symbolic(graph, input_):
        return _reduce(input_)

    @staticmethod
    def forward(ctx, input_):
        return _reduce(input_.clone())

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


class _ScatterToModelParallelRegion(torch.autograd.Function):
    """Keep this rank's last-dimension chunk; all-gather of the gradient."""

    @staticmethod
    def symbolic(graph, input_):
        return _split_along_last_dim(input_)

    @staticmethod
    def forward(ctx, input_):
        return _split_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_last_dim(grad_output)


class _GatherFromModelParallelRegion(torch.autograd.Function):
    """All-gather along the last dimension; split of the gradient."""

    @staticmethod
    def symbolic(graph, input_):
        return _gather_along_last_dim(input_)

    @staticmethod
    def forward(ctx, input_):
        return _gather_along_last_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _split_along_last_dim(grad_output)


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's first-dimension chunk; all-gather of the gradient."""

    @staticmethod
    def symbolic(graph, input_):
        return _split_along_first_dim(input_)

    @staticmethod
    def forward(ctx, input_):
        return _split_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather along the first dimension; the gradient is reduce-scattered when the output feeds a
    tensor-parallel region (``to_model_parallel``), else split."""

    @staticmethod
    def symbolic(graph, input_, to_model_parallel: bool = True):
        return _gather_along_first_dim(input_)

    @staticmethod
    def forward(ctx, input_, to_model_parallel: bool = True):
        ctx.to_model_parallel = to_model_parallel
        return _gather_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.to_model_parallel:
            return _reduce_scatter_along_first_dim(grad_output), None
        return _split_along_first_dim(grad_output), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the first dimension; all-gather of the gradient."""

    @staticmethod
    def symbolic(graph, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def forward(ctx, input_):
        return _reduce_scatter_along_first_dim(input_)

    @staticmethod
    def backward(ctx, grad_output):
        return _gather_along_first_dim(grad_output)


def copy_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient over the tensor-parallel group backward."""
    return _CopyToModelParallelRegion.apply(input_)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-reduce (sum) over the tensor-parallel group forward; identity backward."""
    return _ReduceFromModelParallelRegion.apply(input_)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""
    return _ScatterToModelParallelRegion.apply(input_)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return _GatherFromModelParallelRegion.apply(input_)


def scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Keep this rank's slice of the first (sequence) dim forward; all-gather backward."""
    return _ScatterToSequenceParallelRegion.apply(input_)


def gather_from_sequence_parallel_region(input_: torch.Tensor, to_model_parallel: bool = True) -> torch.Tensor:
    """All-gather along the first (sequence) dim forward; backward reduce-scatters the gradient
    (``to_model_parallel=True``) or keeps this rank's slice.
    """
    return _GatherFromSequenceParallelRegion.apply(input_, to_model_parallel)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor) -> torch.Tensor:
    """Reduce-scatter along the first (sequence) dim forward; all-gather backward."""
    return _ReduceScatterToSequenceParallelRegion.apply(input_)
