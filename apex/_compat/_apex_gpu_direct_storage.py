"""Compatibility module for ``import _apex_gpu_direct_storage`` (Apex's compiled cuFile binding).

``_GDSFile`` is ``apex.contrib.gpu_direct_storage._file._GDSFile``: Apex's methods on ordinary file I/O.
"""

from __future__ import annotations

from apex._compat import lazy_module

_OPS: dict[str, str] = {
    "_GDSFile": "apex.contrib.gpu_direct_storage._file",
}

__getattr__, __dir__ = lazy_module(globals(), _OPS)
