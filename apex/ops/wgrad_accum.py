"""Weight-gradient accumulation (Megatron-LM's gradient-accumulation fusion):
``main_grad += grad_outputᵀ @ input`` over all leading dims, in place.

``input`` ``[..., in]``, ``grad_output`` ``[..., out]`` (same leading dims), ``main_grad`` ``[out, in]``.
``wgrad_gemm_accum_fp32`` needs an fp32 ``main_grad``; ``wgrad_gemm_accum_fp16`` an fp16/bf16 one.

Dtype policy: products accumulated in fp32 and added to ``main_grad`` with one rounding to its dtype
(none for fp32). Inputs may be fp32, fp16 or bf16 (``input`` and ``grad_output`` of one dtype). On the CPU a
half ``main_grad`` with inputs of its dtype is PyTorch's ``addmm_`` in that dtype (fp32 accumulation inside
PyTorch's GEMM; the same bits as ``nn.Linear``'s half weight gradient; slow on CPUs without native half
GEMMs, as every half matmul there is).

Paths, behind the ``apex::wgrad_gemm_accum`` custom op (mutates ``main_grad``): CUDA/ROCm tensors one tiled
Triton GEMM that reads and writes ``main_grad`` once (``apex._kernels.wgrad_accum``); CPU tensors
``main_grad.addmm_`` (no copies for inputs of ``main_grad``'s dtype; half inputs into an fp32 ``main_grad``
are upcast first, since PyTorch's CPU ``addmm`` takes one dtype; fp32 inputs into a half ``main_grad`` go
through an fp32 copy).
"""

from __future__ import annotations

import torch

from apex._backend import select
from apex._errors import RuntimeTypeError
from apex.ops._dispatch import custom_op

Tensor = torch.Tensor
_IN_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(input: Tensor, grad_output: Tensor, main_grad: Tensor, grad_dtypes: tuple, variant: str) -> None:
    # Dtypes Apex's fused_weight_gradient_mlp_cuda did not take (its dispatch, then data_ptr<T> of each tensor)
    # were its RuntimeError: those errors are also one.
    for name, t in (("input", input), ("grad_output", grad_output), ("main_grad", main_grad)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input.dim() < 1 or grad_output.dim() < 1 or input.shape[:-1] != grad_output.shape[:-1]:
        raise ValueError(f"input {list(input.shape)} and grad_output {list(grad_output.shape)} must have the "
                         "same leading dims")
    if input.dtype not in _IN_DTYPES or grad_output.dtype != input.dtype:
        raise RuntimeTypeError(f"input and grad_output must share one dtype of float32/float16/bfloat16, got "
                               f"{input.dtype} and {grad_output.dtype}")
    want = (grad_output.shape[-1], input.shape[-1])
    if main_grad.dim() != 2 or tuple(main_grad.shape) != want:
        raise ValueError(f"main_grad must have shape {list(want)} (grad_output's last dim, input's last dim), "
                         f"got {list(main_grad.shape)}")
    if main_grad.dtype not in grad_dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in grad_dtypes)
        raise RuntimeTypeError(f"{variant} needs a main_grad of dtype {names}, got {main_grad.dtype}")
    if not (input.device == grad_output.device == main_grad.device):
        raise ValueError(f"input, grad_output and main_grad must be on one device, got {input.device}, "
                         f"{grad_output.device}, {main_grad.device}")


def _accumulate(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    a = input.reshape(-1, input.shape[-1])
    g = grad_output.reshape(-1, grad_output.shape[-1])
    if select(main_grad) == "triton":
        from apex._kernels import wgrad_accum as kernels

        kernels.accumulate(a, g, main_grad)
        return
    if main_grad.dtype == torch.float32:
        if a.dtype == torch.float32:
            main_grad.addmm_(g.t(), a)
        else:
            main_grad.addmm_(g.t().float(), a.float())
    elif a.dtype == main_grad.dtype:
        # PyTorch's own fused GEMM-accumulate in the half dtype: bit for bit nn.Linear's half weight gradient
        # when main_grad starts at zero (upstream's tests compare exactly that), no copies.
        main_grad.addmm_(g.t(), a)
    else:
        main_grad.copy_(main_grad.float().addmm_(g.t().float(), a.float()))


@custom_op("apex::wgrad_gemm_accum", mutates_args=("main_grad",))
def _accum_op(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    _accumulate(input, grad_output, main_grad)


@_accum_op.register_fake
def _(input, grad_output, main_grad):
    return None


def wgrad_gemm_accum_fp32(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_outputᵀ @ input`` (leading dims flattened); ``main_grad`` fp32, updated in place."""
    _check(input, grad_output, main_grad, (torch.float32,), "wgrad_gemm_accum_fp32")
    _accum_op(input, grad_output, main_grad)


def wgrad_gemm_accum_fp16(input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """``main_grad += grad_outputᵀ @ input`` for an fp16/bf16 ``main_grad``: fp32 accumulation, one rounding."""
    _check(input, grad_output, main_grad, (torch.float16, torch.bfloat16), "wgrad_gemm_accum_fp16")
    _accum_op(input, grad_output, main_grad)
