"""Apex's ``apex.contrib.torchsched``: the ``"torchsched"`` ``torch.compile`` backend.

Importing this package registers the backend name, as Apex did, so ``torch.compile(model,
backend="torchsched")`` works afterwards. The backend is Inductor plus Apex's convolution-backward
decomposition and optional pre-grad passes; Apex's multi-stream CUDA scheduling is not ported, and every
device uses Inductor's default scheduling (see :mod:`apex.contrib.torchsched.backend`).

``set_default_backend(name)`` makes ``torch.compile`` without ``backend=`` use ``name``: as in Apex it
replaces ``torch.compile`` with :func:`torchsched_compile`; unlike Apex, that replacement happens on the
first ``set_default_backend`` call rather than at import, so importing changes only the backend registry.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo import list_backends, register_backend

from apex._errors import AssertValueError
from apex.contrib.torchsched import config
from apex.contrib.torchsched.backend import get_backend

__all__ = ["get_backend", "set_default_backend", "config"]

torch.ops.import_module("apex.contrib.torchsched.ops")


def torchsched(model_: torch.fx.GraphModule, example_inputs_: list[torch.Tensor], inner_compile=None,
               config_patches: dict[str, Any] | None = None, decompositions: dict | None = None) -> Callable:
    """The registered backend (Apex's signature): :func:`get_backend` ``("torchsched", "dwb")``.
    ``inner_compile`` is accepted and unused; ``config_patches``/``decompositions`` extend the backend's."""
    backend = get_backend(backend="torchsched", scheme="dwb")
    backend.options.update(config_patches or {})
    backend.decompositions.update(decompositions or {})
    return backend(model_, example_inputs_)


if "torchsched" not in list_backends(exclude_tags=()):
    register_backend(torchsched, name="torchsched")

_DEFAULT_BACKEND = "inductor"
__torch_compile__ = torch.compile


def set_default_backend(backend: str) -> None:
    """Make ``backend`` the default of ``torch.compile`` (installs :func:`torchsched_compile`)."""
    global _DEFAULT_BACKEND
    if backend not in list_backends(exclude_tags=()):  # Apex asserts this
        raise AssertValueError(f"Unknown backend {backend!r}; registered: {list_backends(exclude_tags=())}")
    _DEFAULT_BACKEND = backend
    torch.compile = torchsched_compile


def torchsched_compile(*args: object, backend: str | Callable | None = None, **kwargs: object) -> object:
    """``torch.compile`` with ``backend`` defaulting to the one set by :func:`set_default_backend`."""
    return __torch_compile__(*args, backend=_DEFAULT_BACKEND if backend is None else backend, **kwargs)
