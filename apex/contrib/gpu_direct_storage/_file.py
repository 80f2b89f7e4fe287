"""``_GDSFile``: Apex's GPUDirect Storage file object, on ordinary file I/O.

Apex read and wrote a tensor's bytes with cuFile (GPU memory <-> NVMe without a CPU bounce). cuFile is not
available from PyTorch, so every mode here uses POSIX ``pread``/``pwrite``: CPU tensors are read and
written in place from their own memory, CUDA tensors through one host copy. The file format is the same
as Apex's: the tensor's raw bytes (``numel * element_size``, native byte order, no header) at offset 0,
so files written by Apex load here and the other way round; the caller supplies dtype and shape.
"""

from __future__ import annotations

import os

import torch

_MODES = {
    # mode -> (os flags, the methods that may use it); "r"/"w" are Apex's GDS modes, "rn"/"wn" its
    # plain-I/O benchmarking modes. Unlike Apex, writing truncates an existing file, so no stale bytes
    # of a longer earlier tensor remain after the new one.
    "r": (os.O_RDONLY, "load_data"),
    "w": (os.O_CREAT | os.O_WRONLY | os.O_TRUNC, "save_data"),
    "rn": (os.O_RDONLY, "load_data_no_gds"),
    "wn": (os.O_CREAT | os.O_WRONLY | os.O_TRUNC, "save_data_no_gds"),
}

# One pread/pwrite moves at most ~2 GiB on Linux; larger tensors go in chunks.
_CHUNK = 1 << 30


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview sharing its storage."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _check_tensor(tensor: object) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided or tensor.device.type == "meta":
        raise TypeError(f"tensor must be a dense tensor with storage, got layout {tensor.layout} on {tensor.device}")
    return tensor


class _GDSFile:
    """A file opened for saving (``"w"``, ``"wn"``) or loading (``"r"``, ``"rn"``) one tensor's bytes.

    ``save_data``/``load_data`` need modes ``"w"``/``"r"``, the ``*_no_gds`` methods ``"wn"``/``"rn"``
    (as in Apex; here both pairs do the same ordinary I/O). Non-contiguous tensors are handled: saved in
    logical (row-major) order, loaded by copying into the tensor's elements.
    """

    def __init__(self, filename: str | os.PathLike | None = None, mode: str | None = None) -> None:
        self._fd = -1
        self.filename = None
        self.mode = None
        if filename is not None or mode is not None:
            self.open(filename, mode)

    @property
    def is_open(self) -> bool:
        return self._fd >= 0

    def open(self, filename: str | os.PathLike, mode: str) -> None:
        if self.is_open:
            raise RuntimeError(f"file {self.filename} is already open with mode {self.mode!r}")
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(f"filename must be a str or os.PathLike, got {type(filename).__name__}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of 'r', 'w', 'rn', 'wn', got {mode!r}")
        flags, _ = _MODES[mode]
        self._fd = os.open(os.fspath(filename), flags | getattr(os, "O_CLOEXEC", 0), 0o664)
        self.filename, self.mode = os.fspath(filename), mode

    def close(self) -> None:
        if self.is_open:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def __del__(self) -> None:
        self.close()

    def _check_mode(self, method: str) -> None:
        if not self.is_open:
            raise RuntimeError(f"{method}: the file is not open")
        if _MODES[self.mode][1] != method:
            raise RuntimeError(f"{method}: {self.filename} was opened with mode {self.mode!r}")

    def _save(self, tensor: torch.Tensor, method: str) -> None:
        tensor = _check_tensor(tensor)
        self._check_mode(method)
        host = tensor.detach()
        if host.device.type != "cpu":
            host = host.to("cpu")
        data = _byte_view(host.contiguous())
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:done + _CHUNK], done)

    def _load(self, tensor: torch.Tensor, method: str) -> None:
        tensor = _check_tensor(tensor)
        self._check_mode(method)
        nbytes = tensor.numel() * tensor.element_size()
        size = os.fstat(self._fd).st_size
        if size < nbytes:
            # Checked before reading so that a failed load leaves the tensor unchanged.
            raise RuntimeError(f"{method}: {self.filename} holds {size} bytes, the tensor needs {nbytes}")
        direct = tensor.device.type == "cpu" and tensor.is_contiguous()
        buf = tensor.detach() if direct else torch.empty(tensor.shape, dtype=tensor.dtype)
        data = _byte_view(buf)
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [data[done:done + _CHUNK]], done)
            if got <= 0:
                raise RuntimeError(f"{method}: short read from {self.filename} at byte {done} of {nbytes}")
            done += got
        if not direct:
            with torch.no_grad():
                tensor.copy_(buf)

    def save_data(self, tensor: torch.Tensor) -> None:
        """Write ``tensor``'s bytes at offset 0 (mode ``"w"``)."""
        self._save(tensor, "save_data")

    def load_data(self, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` in place from the file's first ``numel * element_size`` bytes (mode ``"r"``)."""
        self._load(tensor, "load_data")

    def save_data_no_gds(self, tensor: torch.Tensor) -> None:
        """As :meth:`save_data`, mode ``"wn"``."""
        self._save(tensor, "save_data_no_gds")

    def load_data_no_gds(self, tensor: torch.Tensor) -> None:
        """As :meth:`load_data`, mode ``"rn"``."""
        self._load(tensor, "load_data_no_gds")
