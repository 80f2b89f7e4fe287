"""Compatibility module for code that does ``import fused_lamb_cuda`` (Apex's legacy contrib LAMB kernel):
``lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, epsilon, step, bias_correction, weight_decay,
grad_averaging, mode, global_grad_norm, max_grad_norm)``, see ``apex.ops.legacy_lamb``.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS = {"lamb": "apex.ops.legacy_lamb"}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
