"""Triton auto-tuning caches of the OpenFold kernels: save, load, and share them across ranks.

Every rank of a data-parallel job must pick the same kernel configs (the LayerNorm backward's results do
not depend on them, but timings and memory do), and tuning on every rank costs minutes; so rank 0's caches
are broadcast. A cache maps a tuning key (the shapes and dtypes) to the chosen ``triton.Config``.

On CPUs and under the Triton interpreter each autotuner holds one fixed config and its cache stays empty:
``sync_triton_auto_tune_cache_across_gpus`` then broadcasts empty caches (a no-op in effect, which still
works with a Gloo process group), and without an initialised process group it returns at once.
"""

from __future__ import annotations

import importlib.util
import pickle
from copy import deepcopy
from typing import BinaryIO

import torch


class TuneableKernels:
    """The autotuned OpenFold kernels by name, imported on first use (so importing apex imports no Triton)."""

    def __init__(self):
        self._kernels: dict | None = None

    def get(self) -> dict:
        if self._kernels is None:
            if importlib.util.find_spec("triton") is None:
                self._kernels = {}
            else:
                from apex._kernels import openfold_layer_norm

                self._kernels = dict(openfold_layer_norm.tuneable_kernels())
        return self._kernels


KERNELS = TuneableKernels()


def _caches(strict: bool) -> dict:
    caches = {}
    for name, fn in KERNELS.get().items():
        if strict and not fn.cache and len(fn.configs) > 1:
            raise ValueError(f"Triton kernel {name} has no auto-tuning cache yet: run it once before saving")
        caches[name] = deepcopy(dict(fn.cache))
    return caches


def _install(caches: dict, strict: bool) -> None:
    kernels = KERNELS.get()
    if not isinstance(caches, dict):
        raise ValueError(f"an auto-tuning cache must be a dict of kernel name to cache, got {type(caches).__name__}")
    unknown = set(caches) - set(kernels)
    if unknown:
        raise ValueError(f"auto-tuning caches for unknown kernels: {sorted(unknown)}")
    if strict and set(caches) != set(kernels):
        raise ValueError(f"auto-tuning caches missing for kernels: {sorted(set(kernels) - set(caches))}")
    for name, cache in caches.items():
        kernels[name].cache = dict(cache)


def _save_triton_auto_tune_cache(f: BinaryIO, verbose: bool = False) -> None:
    """Pickle every tuneable kernel's cache into ``f``; ValueError when a kernel with several configs has
    not been tuned yet (kernels with a single config, such as all of them under the interpreter, have
    nothing to tune and save an empty cache)."""
    pickle.dump(_caches(strict=True), f)
    if verbose:
        print(f"Triton kernel auto-tuning caches written to {f}")


def _load_triton_auto_tune_cache(f: BinaryIO, strict: bool = True, verbose: bool = False) -> None:
    """Install caches written by :func:`_save_triton_auto_tune_cache`. ``strict``: the file must name
    exactly the tuneable kernels. Names that match no kernel are a ValueError either way; nothing is
    installed when any check fails."""
    _install(pickle.load(f), strict)
    if verbose:
        print(f"Triton kernel auto-tuning caches loaded from {f}")


def sync_triton_auto_tune_cache_across_gpus() -> None:
    """Broadcast rank 0's auto-tuning caches to every rank (``broadcast_object_list``); a no-op without an
    initialised ``torch.distributed`` process group. Collective: every rank must call it."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    payload = [_caches(strict=False) if torch.distributed.get_rank() == 0 else None]
    torch.distributed.broadcast_object_list(payload, src=0)
    _install(payload[0], strict=False)
