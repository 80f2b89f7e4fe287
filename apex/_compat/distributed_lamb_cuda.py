"""Compatibility module for code that does ``import distributed_lamb_cuda`` (the kernels of Apex's
``DistributedFusedLAMB``): ``multi_tensor_lamb_compute_update_term(chunk_size, noop_flag, [g, p, m, v, u],
beta1s, beta2s, beta3s, bias_corrections, step, epsilons, mode, decays, global_scale, global_grad_norm,
max_grad_norm)`` and ``multi_tensor_lamb_update_weights(chunk_size, noop_flag, [u, p, p_copy], param_norms,
update_norms, update_norm_offset, lr, decays, global_grad_norm, use_nvlamb)``, see
``apex.contrib.optimizers._dist_lamb_ops``. Names are resolved on first access.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS = {
    "multi_tensor_lamb_compute_update_term": "apex.contrib.optimizers._dist_lamb_ops",
    "multi_tensor_lamb_update_weights": "apex.contrib.optimizers._dist_lamb_ops",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
