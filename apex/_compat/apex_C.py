"""Compatibility module for code that does ``import apex_C`` (Apex's ``flatten``/``unflatten`` extension,
which ``apex.parallel.DistributedDataParallel`` used when built with ``--cpp_ext``).

``flatten(tensors)`` concatenates dense tensors into one contiguous 1-D tensor; ``unflatten(flat, tensors)``
returns views of ``flat`` shaped like ``tensors`` (PyTorch's ``flatten_dense_tensors`` and
``unflatten_dense_tensors``, which Apex's C++ called).
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {"flatten": "apex.parallel._comm", "unflatten": "apex.parallel._comm"}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
