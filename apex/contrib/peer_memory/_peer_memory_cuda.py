"""The functions of Apex's ``peer_memory_cuda`` extension, with its positional signatures, without CUDA IPC.

* ``allocate_raw`` / ``free_raw`` / ``zero`` / ``blob_view_*`` manage raw buffers by address as Apex does: an
  allocation is a PyTorch uint8 tensor (on the current CUDA device, else the CPU) kept alive in a
  process-wide table, and ``blob_view_*(raw + offset, ...)`` is a tensor view of it.
* ``get_raw_ipc_address`` returns a 64-byte token naming the allocation (process id + address) and
  ``get_raw_peers`` maps tokens back to addresses only for allocations of this same process: mapping another
  process's memory needs CUDA IPC, which PyTorch does not expose. It raises a RuntimeError for those.
* ``push_pull_halos_1d`` exchanges the halos with ``torch.distributed`` send/recv: the neighbours are global
  ranks ``peer_rank - 1`` and ``peer_rank + 1`` (modulo the world size) of the default group (Apex's layout,
  with the peer group being the whole job); the transfer buffers are not needed and ignored, ``top_zero`` /
  ``btm_zero`` skip that side and zero its input halo, as Apex does.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from apex.contrib.peer_memory._halo import exchange_halos

_TOKEN_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class _RawAllocations:
    """address -> uint8 tensor holding that allocation."""

    def __init__(self) -> None:
        self._blocks: dict[int, torch.Tensor] = {}

    def allocate(self, size: int) -> int:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        block = torch.zeros(max(size, 1), dtype=torch.uint8, device=device)
        self._blocks[block.data_ptr()] = block
        return block.data_ptr()

    def free(self, raw: int) -> None:
        if self._blocks.pop(raw, None) is None:
            raise ValueError(f"free_raw: {raw:#x} is not an address returned by allocate_raw")

    def view(self, raw: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` bytes at address ``raw`` (inside one allocation) as a uint8 tensor."""
        for base, block in self._blocks.items():
            if base <= raw and raw + nbytes <= base + block.numel():
                return block[raw - base:raw - base + nbytes]
        raise ValueError(f"address range [{raw:#x}, {raw + nbytes:#x}) is not inside one allocate_raw allocation")


_RAW = _RawAllocations()


def allocate_raw(size: int) -> int:
    """Address of ``size`` new zeroed bytes."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"allocate_raw: size must be a non-negative int, got {size!r}")
    return _RAW.allocate(size)


def free_raw(raw: int) -> None:
    """Release a buffer from ``allocate_raw``."""
    _RAW.free(raw)


def zero(raw: int, size: int) -> None:
    """Zero the first ``size`` bytes of a raw buffer."""
    _RAW.view(raw, size).zero_()


def get_raw_ipc_address(raw: int) -> torch.Tensor:
    """A 64-byte uint8 token for the allocation at ``raw``: (process id, address)."""
    _RAW.view(raw, 0)
    token = torch.zeros(_TOKEN_BYTES, dtype=torch.uint8)
    token[:16].view(torch.int64).copy_(torch.tensor([os.getpid(), raw], dtype=torch.int64))
    return token


def get_raw_peers(ipc_addresses: torch.Tensor, peer_rank: int, raw: int) -> list[int]:
    """Addresses of every peer's allocation from the gathered tokens (``ipc_addresses[peer_rank]`` is ours)."""
    tokens = ipc_addresses.detach().to("cpu", torch.uint8).reshape(-1, _TOKEN_BYTES)
    out = []
    for i, token in enumerate(tokens):
        pid, addr = token[:16].clone().view(torch.int64).tolist()
        if i == peer_rank:
            out.append(raw)
        elif pid == os.getpid():
            out.append(addr)
        else:
            raise RuntimeError("get_raw_peers: mapping another process's memory needs CUDA IPC, which is not "
                               "available; exchange halos with apex.contrib.peer_memory.PeerHaloExchanger1d or "
                               "apex.contrib.bottleneck.HaloExchangerSendRecv (torch.distributed send/recv)")
    return out


def _blob_view(raw: int, shape: Sequence[int], channels_last: bool, dtype: torch.dtype) -> torch.Tensor:
    shape = [int(s) for s in shape]
    elem = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    flat = _RAW.view(raw, n * elem).view(dtype)
    if channels_last:
        if len(shape) != 4:
            raise ValueError(f"channels_last needs a 4-d shape, got {shape}")
        _, c, h, w = shape
        return flat.as_strided(shape, (h * w * c, 1, w * c, c))
    return flat.view(shape)


def blob_view_half(raw: int, shape: Sequence[int], channels_last: bool) -> torch.Tensor:
    """An fp16 tensor of ``shape`` over a raw buffer (channels_last strides if asked)."""
    return _blob_view(raw, shape, channels_last, torch.float16)


def blob_view_float(raw: int, shape: Sequence[int], channels_last: bool) -> torch.Tensor:
    """An fp32 tensor of ``shape`` over a raw buffer (channels_last strides if asked)."""
    return _blob_view(raw, shape, channels_last, torch.float32)


def blob_view_int(raw: int, shape: Sequence[int], channels_last: bool) -> torch.Tensor:
    """An int32 tensor of ``shape`` over a raw buffer (channels_last strides if asked)."""
    return _blob_view(raw, shape, channels_last, torch.int32)


def push_pull_halos_1d(diagnostics: bool, explicit_nhwc: bool, numSM: int, peer_rank: int, top_zero: bool,
                       top_out_halo: torch.Tensor, top_inp_transfer, top_out_transfer, top_inp_halo: torch.Tensor,
                       btm_zero: bool, btm_out_halo: torch.Tensor, btm_inp_transfer, btm_out_transfer,
                       btm_inp_halo: torch.Tensor) -> None:
    """``top_out_halo`` to rank ``peer_rank - 1`` whose bottom input halo receives it, ``btm_out_halo`` to rank
    ``peer_rank + 1``; ``top_inp_halo`` / ``btm_inp_halo`` receive theirs, or are zeroed with ``top_zero`` /
    ``btm_zero``. ``diagnostics``, ``explicit_nhwc`` (halos of any layout work), ``numSM`` and the transfer
    buffers served Apex's kernel and are ignored."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    top = None if top_zero else (peer_rank - 1) % world
    btm = None if btm_zero else (peer_rank + 1) % world
    exchange_halos(top_out_halo, btm_out_halo, top_inp_halo, btm_inp_halo, top, btm)
