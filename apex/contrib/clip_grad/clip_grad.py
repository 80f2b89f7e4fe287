"""``apex.contrib.clip_grad.clip_grad``, Apex's module path of :func:`clip_grad_norm_`."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from apex.ops.clip_grad_norm import clip_grad_norm_

# Apex's flag for "the fused multi-tensor kernels imported"; they always exist here (Triton or PyTorch path).
_kernel_import_succeeded = True
_tensor_or_tensors = torch.Tensor | Iterable[torch.Tensor]

__all__ = ["clip_grad_norm_"]
