"""Compatibility module for code that does ``import amp_C`` (Megatron-LM, NeMo, fairseq, Apex's tests).

Every name is an apex operation with Apex's signature ``op(chunk_size, noop_flag, tensor_lists, *args)``,
running a Triton multi-tensor kernel on GPUs and PyTorch's foreach/fused operators on CPUs. Like Apex's
kernels, the ops write their tensors' data outside autograd, so parameters that require grad may be
passed without ``torch.no_grad()``. Names are resolved on first access, so ``import amp_C`` stays cheap.
"""

from __future__ import annotations

from apex._compat import lazy_module

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

__getattr__, __dir__ = lazy_module(globals(), _OPS)
