"""apex: NVIDIA Apex's API rebuilt in Python, with Triton kernels on GPUs and PyTorch paths on CPUs.

Importing ``apex`` is cheap: no subpackage, no Triton and no CUDA query is touched until first use.
Every public subpackage is still reachable as an attribute (``apex.optimizers.FusedAdam``) and is
imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from apex._backend import backend, current_backend

__version__ = "0.1.0"

# Public subpackages, imported on first attribute access (PEP 562).
_SUBMODULES = (
    "RNN",
    "amp",
    "contrib",
    "fp16_utils",
    "fused_dense",
    "mlp",
    "multi_tensor_apply",
    "normalization",
    "optimizers",
    "parallel",
    "testing",
    "transformer",
)

__all__ = ["backend", "current_backend", "__version__", *_SUBMODULES]

if TYPE_CHECKING:  # pragma: no cover
    from apex import (  # noqa: F401
        RNN,
        amp,
        contrib,
        fp16_utils,
        fused_dense,
        mlp,
        multi_tensor_apply,
        normalization,
        optimizers,
        parallel,
        testing,
        transformer,
    )


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        module = importlib.import_module(f"apex.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'apex' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public names only, not this module's own imports (importlib, typing's names).
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})
