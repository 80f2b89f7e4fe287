"""``clip_grad_norm_``: clip the global gradient norm of many parameters with two multi-tensor passes.

Same contract as ``torch.nn.utils.clip_grad_norm_``: the total norm ``‖g‖`` of all gradients (as if
concatenated) is returned as a 0-d fp32 tensor, and every gradient is multiplied in place by
``min(1, max_norm / (‖g‖ + 1e-6))``. For the L2 norm of dense fp32/fp16/bf16 gradients on one device, the
norm is one ``multi_tensor_l2norm`` on GPUs (fp32 accumulation for every dtype, as Apex's CUDA kernel; unlike
PyTorch, which takes each half-precision gradient's norm in its own dtype) and on the PyTorch path one
``torch._foreach_norm`` accumulated in fp64, so that the result does not depend on the CPU's vector width;
the scaling is one ``multi_tensor_scale`` (in fp32, rounded once) whose coefficient stays on the device, so
nothing waits for the host unless ``error_if_nonfinite`` asks for a check. Other norms and layouts are
handed to ``torch.nn.utils.clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from apex import _backend
from apex.ops._checks import FLOAT_DTYPES
from apex.ops.multi_tensor_l2norm import multi_tensor_l2norm
from apex.ops.multi_tensor_scale import multi_tensor_scale

_CHUNK = 2048 * 32


def _cpu_total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The total L2 norm (0-d fp32) accumulated in fp64 and rounded once. PyTorch's CPU reductions sum in
    an order set by the vector width of the kernels it picks for the CPU (AVX2, AVX-512, ...); in fp32 that
    moves the norm's last bits, and through the clipping coefficient the scaled gradients', from one CPU
    to another. In fp64 the ordering error is far below half an fp32 step, so the rounded norm, the
    coefficient and the gradients are the same on every CPU."""
    per = torch._foreach_norm(grads, 2.0, dtype=torch.float64)
    return torch.linalg.vector_norm(torch.stack(per)).to(torch.float32)


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of ``parameters`` in place so that their total ``norm_type`` norm is at most
    ``max_norm``; returns the total norm before clipping (fp32).

    As ``torch.nn.utils.clip_grad_norm_``: the gradients are multiplied by ``min(1, max_norm / (norm + 1e-6))``;
    the norm is computed with the multi-tensor L2-norm kernel (one launch per device and dtype on GPUs).
    ``error_if_nonfinite=True`` raises ``RuntimeError`` on an inf/NaN norm. ``max_norm`` must be a number
    (``TypeError`` otherwise).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
    max_norm, norm_type = float(max_norm), float(norm_type)
    if not params:
        return torch.tensor(0.0)
    grads = [p.grad.detach() for p in params]
    fused = (norm_type == 2.0 and len({g.device for g in grads}) == 1
             and all(g.dtype in FLOAT_DTYPES and g.is_contiguous() and not g.is_sparse for g in grads))
    if not fused:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type,
                                              error_if_nonfinite=error_if_nonfinite)
    noop = torch.zeros(1, dtype=torch.int32, device=grads[0].device)
    if _backend.select(grads) == "triton":
        total, _ = multi_tensor_l2norm(_CHUNK, noop, [grads], False)
        total = total.reshape(())
    else:
        total = _cpu_total_norm(grads)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                           "so it cannot be clipped. To disable this error and scale the gradients by the "
                           "non-finite norm anyway, set `error_if_nonfinite=False`")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    multi_tensor_scale(_CHUNK, noop, [grads, grads], coef)
    return total
