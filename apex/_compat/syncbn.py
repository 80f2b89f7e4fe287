"""Compatibility module for ``import syncbn`` (Apex's compiled SyncBatchNorm kernels, ``csrc/syncbn.cpp``).

Every name keeps Apex's positional signature; they live in ``apex.ops._syncbn_compat`` over
``apex.ops.sync_batch_norm`` (Triton kernels on GPUs, PyTorch's fused batch-norm operators on CPUs).
"""

from __future__ import annotations

from apex._compat import lazy_module

_M = "apex.ops._syncbn_compat"

_OPS: dict[str, str] = {name: _M for name in (
    "welford_mean_var",
    "welford_parallel",
    "batchnorm_forward",
    "reduce_bn",
    "batchnorm_backward",
    "welford_mean_var_c_last",
    "batchnorm_forward_c_last",
    "reduce_bn_c_last",
    "batchnorm_backward_c_last",
    "relu_bw_c_last",
)}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
