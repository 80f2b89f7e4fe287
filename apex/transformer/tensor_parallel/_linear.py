"""The linear function of the tensor-parallel layers: ``y = x W^T + b`` whose backward overlaps the
input-gradient communication (all-reduce, or reduce-scatter under sequence parallelism) with the
weight-gradient GEMM, and can accumulate the weight gradient into ``weight.main_grad`` in fp32."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from apex._errors import AssertValueError
from apex.transformer.parallel_state import get_tensor_model_parallel_group, get_tensor_model_parallel_world_size

_NONES = (None, None, None, None)


def _all_gather_first_dim(input_: torch.Tensor, async_op: bool = False):
    world_size = get_tensor_model_parallel_world_size()
    out = input_.new_empty((input_.size(0) * world_size, *input_.shape[1:]))
    handle = dist.all_gather_into_tensor(out, input_.contiguous(), group=get_tensor_model_parallel_group(),
                                         async_op=async_op)
    return out, handle


def _accumulate_main_grad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (both 2-D), through apex.transformer.functional."""
    if main_grad.dtype == torch.float32:
        name = "wgrad_gemm_accum_fp32"
    elif main_grad.dtype in (torch.float16, torch.bfloat16):
        name = "wgrad_gemm_accum_fp16"
    else:
        raise RuntimeError(f"unsupported dtype for main_grad ({main_grad.dtype})")
    try:
        from apex.transformer import functional
        fn = getattr(functional, name)
    except ImportError:
        fn = None
    if fn is not None:
        fn(total_input, grad_output, main_grad)
    else:  # apex.transformer.functional.fused_weight_gradient not available: same math, one addmm.
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``x W^T + b``. ``sequence_parallel_enabled``: ``x`` is this rank's sequence chunk and is
    all-gathered along dim 0 first (and again in the backward, instead of being saved whole); the input
    gradient is reduce-scattered. ``async_grad_allreduce``: the input gradient is all-reduced over the
    tensor group while the weight gradient is computed. ``gradient_accumulation_fusion``: the weight
    gradient is added to ``weight.main_grad`` and ``None`` is returned for it."""

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce,
                sequence_parallel_enabled, use_16bit_in_wgrad_accum_fusion=None):
        if async_grad_allreduce and sequence_parallel_enabled:  # Apex asserts this in backward
            raise AssertValueError("async_grad_allreduce and sequence_parallel_enabled cannot both be True")
        if use_16bit_in_wgrad_accum_fusion is not None:
            warnings.warn(f"Deprecated option `use_16bit_in_wgrad_accum_fusion` is set to "
                          f"{use_16bit_in_wgrad_accum_fusion}", stacklevel=2)
        ctx.use_bias = bias is not None and weight.requires_grad
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.async_grad_allreduce = async_grad_allreduce
        ctx.sequence_parallel_enabled = sequence_parallel_enabled
        ctx.compute_weight_gradient = weight.requires_grad
        if ctx.compute_weight_gradient:
            ctx.save_for_backward(input, weight)
        else:
            ctx.save_for_backward(weight)
        total_input = _all_gather_first_dim(input)[0] if sequence_parallel_enabled else input
        # F.linear, not matmul: the same kernels (and fp16 rounding) as the unsharded nn.Linear.
        output = torch.nn.functional.linear(total_input, weight)
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        if ctx.compute_weight_gradient:
            input, weight = ctx.saved_tensors
        else:
            (weight,), input = ctx.saved_tensors, None
        group = get_tensor_model_parallel_group() if (ctx.sequence_parallel_enabled or ctx.async_grad_allreduce) \
            else None
        handle = None
        total_input = input
        if ctx.compute_weight_gradient and ctx.sequence_parallel_enabled:
            # Re-gather the input while the input gradient is computed.
            total_input, handle = _all_gather_first_dim(input, async_op=True)
        grad_input = grad_output.matmul(weight)
        if handle is not None:
            handle.wait()
        handle = None
        if ctx.sequence_parallel_enabled:
            world_size = get_tensor_model_parallel_world_size()
            sub_grad_input = grad_input.new_empty((grad_input.size(0) // world_size, *grad_input.shape[1:]))
            handle = dist.reduce_scatter_tensor(sub_grad_input, grad_input.contiguous(), group=group, async_op=True)
            grad_input = sub_grad_input
        elif ctx.async_grad_allreduce:
            handle = dist.all_reduce(grad_input, group=group, async_op=True)

        grad_weight = grad_bias = None
        if ctx.compute_weight_gradient:
            # Overlapped with the communication above.
            g2d = grad_output.contiguous().view(-1, grad_output.size(-1))
            x2d = total_input.contiguous().view(-1, total_input.size(-1))
            if ctx.gradient_accumulation_fusion:
                if not hasattr(weight, "main_grad"):
                    raise RuntimeError("attempted to perform gradient accumulation fusion on param without setting "
                                       "main_grad")
                _accumulate_main_grad(x2d, g2d, weight.main_grad)
            else:
                grad_weight = g2d.t().matmul(x2d)
            grad_bias = g2d.sum(dim=0) if ctx.use_bias else None
        if handle is not None:
            handle.wait()
        return (grad_input, grad_weight, grad_bias) + _NONES


def _autocast_args(*args):
    """Cast floating tensors to the autocast dtype when autocast is on for their device (the function
    itself then runs with autocast off, as Apex's ``_cast_if_autocast_enabled``)."""
    device_type = args[0].device.type
    if not torch.is_autocast_enabled(device_type):
        return args, device_type
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args), device_type


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    async_grad_allreduce: bool,
    sequence_parallel_enabled: bool,
) -> torch.Tensor:
    """Functional form of :class:`LinearWithGradAccumulationAndAsyncCommunication` (autocast-aware)."""
    args, device_type = _autocast_args(input, weight, bias, gradient_accumulation_fusion, async_grad_allreduce,
                                       sequence_parallel_enabled)
    with torch.autocast(device_type, enabled=False):
        return LinearWithGradAccumulationAndAsyncCommunication.apply(*args)
