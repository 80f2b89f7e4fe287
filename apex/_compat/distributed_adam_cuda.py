"""Compatibility module for code that does ``import distributed_adam_cuda`` (the kernels of Apex's
``DistributedFusedAdam``).

Every name has Apex's positional signature ``op(chunk_size, noop_flag, tensor_lists, grad_scale, lr, beta1,
beta2, eps, step, mode, bias_correction, weight_decay)`` and runs apex's multi-tensor Adam
(``apex.ops.multi_tensor_adam``) on the lists ``[p_in, m, v, g, p_out]`` (``[p_in, p_rem, m, v, g, p_out]``
for the bf16-with-remainders variant). Names are resolved on first access, so the import stays cheap.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS = {
    "multi_tensor_fused_adam": "apex.contrib.optimizers._zero_buckets",
    "multi_tensor_fused_adam_capturable": "apex.contrib.optimizers._zero_buckets",
    "multi_tensor_fused_adam_with_param_remainders": "apex.contrib.optimizers._zero_buckets",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
