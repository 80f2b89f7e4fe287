"""The home of the compatibility modules: Apex's compiled-extension names (``amp_C``,
``fused_layer_norm_cuda``, ...) as importable top-level modules.

Each module in this folder is installed as a top-level module of its own name (``pyproject.toml`` maps
this folder to the root package, ``[tool.setuptools] package-dir``), so ``import amp_C`` keeps working
without a compiled extension. A module is a table of names (name -> the ``apex`` module that holds it)
handed to :func:`lazy_module`, which resolves each name on first access: importing a compatibility module
imports nothing else of apex. To add one, write ``<name>.py`` here with its table, and add the name to
``py-modules`` in ``pyproject.toml`` and to ``MODULES`` below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping

# Every compatibility module, installed at the top level.
MODULES = (
    "amp_C",
    "apex_C",
    "fused_layer_norm_cuda",
    "scaled_upper_triang_masked_softmax_cuda",
    "scaled_masked_softmax_cuda",
    "scaled_softmax_cuda",
    "generic_scaled_masked_softmax_cuda",
    "fused_rotary_positional_embedding",
    "fused_weight_gradient_mlp_cuda",
    "fused_bias_swiglu",
    "mlp_cuda",
    "fused_dense_cuda",
    "xentropy_cuda",
    "focal_loss_cuda",
    "fast_layer_norm",
    "fused_index_mul_2d",
    "transducer_joint_cuda",
    "transducer_loss_cuda",
    "group_norm_cuda",
    "fused_conv_bias_relu",
    "fast_multihead_attn",
    "fmhalib",
    "bnp",
    "fused_adam_cuda",
    "fused_lamb_cuda",
    "distributed_adam_cuda",
    "distributed_lamb_cuda",
    "peer_memory_cuda",
    "nccl_p2p_cuda",
    "fast_bottleneck",
    "_apex_nccl_allocator",
    "_apex_gpu_direct_storage",
    "_nccl_version_getter",
    "cudnn_gbn_lib",
    "group_norm_v2_cuda",
    "syncbn",
    "permutation_search_cuda",
)


def lazy_module(namespace: dict, table: Mapping[str, str]) -> tuple[Callable, Callable]:
    """PEP 562 ``__getattr__`` and ``__dir__`` for the module whose globals are ``namespace``.

    ``table`` maps each public name to the module holding it, or to ``"module:attr"`` where the name
    differs there. A resolved name is cached in ``namespace``; ``__all__`` is set to the table's names.
    """
    module_name = namespace["__name__"]
    namespace["__all__"] = sorted(table)

    def __getattr__(name: str):
        target = table.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        mod, _, attr = target.partition(":")
        value = getattr(importlib.import_module(mod), attr or name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(table))

    return __getattr__, __dir__
