"""apex: NVIDIA Apex's API rebuilt in Python, with Triton kernels on GPUs and PyTorch paths on CPUs.

Importing ``apex`` is cheap: no subpackage, no Triton and no CUDA query is touched until first use.
Every public subpackage is still reachable as an attribute (``apex.optimizers.FusedAdam``) and is
imported on first access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch

# The oldest PyTorch this package is tested with (pyproject's floor): older releases lack private
# functions the fast paths call (torch._C._any_requires_grad, ...), which would fail later and less clearly.
# Compared on (major, minor) alone: NVIDIA's containers ship pre-releases such as "2.8.0a0+5228986.nv25.6".
_MIN_TORCH = (2, 8)
if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < _MIN_TORCH:
    raise ImportError(f"apex needs torch>={_MIN_TORCH[0]}.{_MIN_TORCH[1]}, found torch {torch.__version__}: "
                      f"pip install 'torch>={_MIN_TORCH[0]}.{_MIN_TORCH[1]}'")

from apex._backend import backend, current_backend  # noqa: E402

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

__all__ = ["backend", "current_backend", "__version__", "DeprecatedFeatureWarning", "deprecated_warning",
           "check_cudnn_version_and_warn", *_SUBMODULES]


class DeprecatedFeatureWarning(FutureWarning):
    """Apex's category for its deprecation notices; kept so warning filters written against it still work
    (this package deprecates nothing and emits none itself)."""


def deprecated_warning(msg: str) -> None:
    """Apex's helper: warn ``msg`` as a :class:`DeprecatedFeatureWarning`, on rank 0 only when
    ``torch.distributed`` is initialised."""
    import warnings

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=2)


def check_cudnn_version_and_warn(global_option: str, required_cudnn_version: int) -> bool:
    """Apex's cuDNN version gate: True when cuDNN ``required_cudnn_version`` or later is available, else
    warn (naming ``global_option``) and return False. Nothing in this package needs cuDNN; kept for clients."""
    import warnings

    import torch

    available = torch.backends.cudnn.is_available()
    version = torch.backends.cudnn.version() if available else None
    if not (available and version is not None and version >= required_cudnn_version):
        warnings.warn(f"`{global_option}` depends on cuDNN {required_cudnn_version} or later, but "
                      f"{'cuDNN is not available' if not available else version}", stacklevel=2)
        return False
    return True

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
