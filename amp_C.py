"""Compatibility module for code that does ``import amp_C`` (Megatron-LM, NeMo, fairseq, Apex's tests).

Every name is an apex operation with Apex's signature ``op(chunk_size, noop_flag, tensor_lists, *args)``,
running a Triton multi-tensor kernel on GPUs and PyTorch's foreach/fused operators on CPUs. Like Apex's
kernels, the ops write their tensors' data outside autograd, so parameters that require grad may be
passed without ``torch.no_grad()``. Names are resolved on first access, so ``import amp_C`` stays cheap.
"""

from __future__ import annotations

import importlib

_OPS = {
    "multi_tensor_scale": "apex.ops.multi_tensor_scale",
    "multi_tensor_axpby": "apex.ops.multi_tensor_axpby",
    "multi_tensor_l2norm": "apex.ops.multi_tensor_l2norm",
    "multi_tensor_l2norm_mp": "apex.ops.multi_tensor_l2norm",
    "multi_tensor_l2norm_scale": "apex.ops.multi_tensor_l2norm",
    "multi_tensor_unscale_l2norm": "apex.ops.multi_tensor_l2norm",
    "multi_tensor_norm_out_cuda": "apex.ops.multi_tensor_l2norm",
    "multi_tensor_adam": "apex.ops.multi_tensor_adam",
    "multi_tensor_adam_capturable": "apex.ops.multi_tensor_adam",
    "multi_tensor_adam_capturable_master": "apex.ops.multi_tensor_adam",
    "multi_tensor_sgd": "apex.ops.multi_tensor_sgd",
    "multi_tensor_adagrad": "apex.ops.multi_tensor_adagrad",
    "multi_tensor_novograd": "apex.ops.multi_tensor_novograd",
    "multi_tensor_lamb": "apex.ops.multi_tensor_lamb",
    "multi_tensor_lamb_mp": "apex.ops.multi_tensor_lamb",
    "multi_tensor_lamb_stage1_cuda": "apex.ops.multi_tensor_lamb",
    "multi_tensor_lamb_stage2_cuda": "apex.ops.multi_tensor_lamb",
    "multi_tensor_lars": "apex.ops.multi_tensor_lars",
    "update_scale_hysteresis": "apex.ops.update_scale_hysteresis",
}

__all__ = sorted(_OPS)


def _lazy_names(module_name: str, table: dict, namespace: dict):
    """PEP 562 ``__getattr__`` and ``__dir__`` for a compatibility module whose names live in ``table``
    (name -> module holding it); a resolved name is cached in ``namespace``. Shared with
    ``fused_layer_norm_cuda``; it imports nothing, so ``import amp_C`` stays cheap."""

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__


__getattr__, __dir__ = _lazy_names(__name__, _OPS, globals())
