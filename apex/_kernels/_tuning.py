"""Launch configurations of the memory-bound kernels: measured on a named GPU, else a formula.

A launcher asks :func:`pick` for its configuration (rows per program, warps, stages, programs per SM, ...)
with its operation's name and the problem's key (the row count first, then the sizes that must match
exactly) and passes its formula's answer as the default. The answer comes from, in order:

1. :func:`override` -- a configuration forced for one operation (``benchmarks/sweep_kernels.py`` times each
   candidate this way);
2. the table measured on this GPU (``_tuned.TABLES``, keyed by ``torch.cuda.get_device_name``, written by
   the sweep): the entry with the same dtype size and exact sizes whose row count is nearest, within a
   factor of 4;
3. the formula.

Nothing here runs at import time; the device's name and SM count are asked once per device and cached.
:func:`assume_device` stands in a GPU's name and SM count for CPU tensors, so that a launch compiled
without a GPU (``apex.testing.triton_compile``) takes the configuration and grid it would take there.

Launchers keep what they derive from :func:`pick` (grid, block sizes, buffer shapes) in a :func:`plan_cache`
keyed by the few integers that determine it, so that a call with a shape seen before costs a dict lookup.
Those caches are emptied whenever :func:`pick`'s answer could change: an :func:`override` or an
:func:`assume_device` block begins or ends, or :func:`invalidate` is called (after replacing
``_tuned.TABLES`` in a running process).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator

import torch

_overrides: dict[str, dict] = {}
last: dict[str, dict] = {}  # the configuration each op's latest launch took (what a sweep reports)
_assumed: list[tuple[str, int]] = []
_plan_caches: list[dict] = []


def plan_cache() -> dict:
    """A dict for one launcher's launch plans, emptied by :func:`invalidate` (see the module docstring)."""
    cache: dict = {}
    _plan_caches.append(cache)
    return cache


def invalidate() -> None:
    """Forget every cached launch plan: the next launch of each shape asks :func:`pick` again."""
    for cache in _plan_caches:
        cache.clear()


@contextlib.contextmanager
def override(op: str, **config) -> Iterator[None]:
    """Within the block, launches of ``op`` take ``config`` (keys as that launcher's table entries)."""
    previous = _overrides.get(op)
    _overrides[op] = dict(config)
    invalidate()
    try:
        yield
    finally:
        if previous is None:
            _overrides.pop(op, None)
        else:
            _overrides[op] = previous
        invalidate()


@contextlib.contextmanager
def assume_device(name: str, sms: int) -> Iterator[None]:
    """Within the block, CPU tensors are launched for as if on a GPU named ``name`` with ``sms`` SMs."""
    _assumed.append((name, int(sms)))
    invalidate()
    try:
        yield
    finally:
        _assumed.pop()
        invalidate()


@functools.cache
def _cuda_device(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def device(dev: torch.device) -> tuple[str | None, int | None]:
    """(name, SM count) of the GPU a launch on ``dev`` runs on; (None, None) on the interpreter's CPU."""
    if dev.type == "cuda":
        return _cuda_device(dev.index if dev.index is not None else torch.cuda.current_device())
    if _assumed:
        return _assumed[-1]
    return None, None


def _table(name: str | None) -> dict:
    if name is None:
        return {}
    from apex._kernels import _tuned

    return _tuned.TABLES.get(name, {})


def lookup(op: str, name: str | None, itemsize: int, key: tuple[int, ...]) -> dict | None:
    """The measured configuration of ``op`` on GPU ``name`` for ``key = (rows, *sizes)``, or None."""
    best, distance = None, math.log(4.0) + 1e-9
    for entry in _table(name).get(op, ()):
        if entry["itemsize"] != itemsize or tuple(entry["key"][1:]) != tuple(key[1:]):
            continue
        d = abs(math.log(max(key[0], 1) / max(entry["key"][0], 1)))
        if d <= distance:
            best, distance = entry["config"], d
    return best


def pick(op: str, dev: torch.device, itemsize: int, key: tuple[int, ...], default: dict,
         measured_base: dict | None = None) -> dict:
    """The configuration of one launch: the override, else the table, else ``default`` (the formula's).
    Keys the override or the table leave out keep the formula's value. ``measured_base``: what a table entry
    completes instead, where the formula may choose a kernel design (a key) that entries measured before it
    existed do not name: the formula's configuration of the design they were measured for."""
    forced = _overrides.get(op)
    if forced is not None:
        chosen = {**default, **forced}
    else:
        measured = lookup(op, device(dev)[0], itemsize, key)
        chosen = {**(default if measured_base is None else measured_base), **measured} if measured else default
    last[op] = chosen
    return chosen
