"""Apex's ``apex.contrib.gpu_direct_storage``: ``GDSFile(filename, mode)``, saving and loading a tensor's raw
bytes. Apex used GPUDirect Storage (cuFile); here it is ordinary file I/O on every device (see
:mod:`apex.contrib.gpu_direct_storage._file`), with the same file format and methods."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from apex.contrib.gpu_direct_storage._file import _GDSFile

__all__ = ["GDSFile"]


@contextmanager
def GDSFile(filename: str | os.PathLike, mode: str) -> Iterator[_GDSFile]:
    """Open ``filename`` with ``mode`` (``"r"``, ``"w"``, ``"rn"``, ``"wn"``) and close it on exit.

    Example: ``with GDSFile("x.data", "w") as f: f.save_data(x)`` and later
    ``with GDSFile("x.data", "r") as f: f.load_data(y)`` fills ``y`` (same dtype and numel) in place.
    """
    handle = _GDSFile(filename, mode)
    try:
        yield handle
    finally:
        handle.close()
