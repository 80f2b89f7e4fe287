"""Run a test function on N Gloo ranks on this machine (``torch.multiprocessing.spawn``).

The ranks compute on the CPU, or all on one GPU (``device="cuda:0"``): NCCL refuses two ranks on one device,
but Gloo carries CUDA tensors (its collectives stage them through pinned host memory), so one GPU is enough
to run distributed code on CUDA tensors. Gloo's point-to-point ``send``/``recv`` are the exception: they
hand the tensor's address to the TCP transport and fail on device memory ("Bad address").
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import socket
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PORT_ATTEMPTS = 3


def _rank_device(device: torch.device | str | None) -> torch.device | None:
    """The device every rank computes on (None: the CPU), checked in the parent before anything is spawned."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        raise ValueError(f"run_distributed: device must be a CPU or CUDA device (what Gloo carries), got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"run_distributed(device={str(device)!r}): no CUDA device is visible")
    return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())


def _on_device(device: torch.device | None):
    """Inside a rank: select ``device`` and create the tensors the test makes without a device there."""
    if device is None:
        return contextlib.nullcontext()
    from apex.testing.device import OnDevice

    torch.cuda.set_device(device)
    # The tests compare fp32 results with fp32 (or float64) references: TF32 would put matmuls and cuDNN's
    # convolutions ~1e-3 off on the GPU, where the same code on the CPU is exact.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return OnDevice(device)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, timeout_s: float,
            device: torch.device | None = None) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    on_device = _on_device(device)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        with on_device:
            fn(rank, world_size, *args)
        dist.barrier()
    finally:
        # Objects of the test kept alive only by reference cycles (optimizers and their hooks) may hold
        # Gloo works and their tensors; freed at interpreter shutdown, a tensor's release takes the GIL from
        # a Gloo thread and aborts the process. Collect them while the interpreter and the group are alive.
        gc.collect()
        dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int = 2, *args, timeout_s: float = 60.0,
                    device: torch.device | str | None = None) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` Gloo ranks and wait for all of them.

    ``fn`` must be picklable (a module-level function). An exception on any rank fails the call.
    The process group's timeout makes a hung rank fail the others instead of blocking forever.

    ``device``: ``None`` or a CPU device (the default) runs the ranks on the CPU; a CUDA device runs every
    rank on that one GPU: each rank selects it, turns TF32 off, and calls ``fn`` under
    :class:`apex.testing.device.OnDevice`, so the tensors and modules ``fn`` creates without naming a device
    are made there (``RuntimeError`` when no CUDA device is visible).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    rank_device = _rank_device(device)
    for attempt in range(_PORT_ATTEMPTS):
        try:
            mp.spawn(_worker, args=(world_size, _free_port(), fn, args, timeout_s, rank_device), nprocs=world_size,
                     join=True)
            return
        except mp.ProcessRaisedException as e:
            # The free port can be taken by a parallel test between _free_port() and rank 0's store binding
            # it. That fails in init_process_group, before fn runs, so the whole spawn can be retried.
            if "EADDRINUSE" not in str(e) or attempt == _PORT_ATTEMPTS - 1:
                raise


_OUTCOME = "outcome.txt"


def stall_rank_one(rank: int, out_dir: str, call: Callable[[], object]) -> None:
    """Body of a dead-rank test, run inside ``run_distributed``: rank 1 never joins ``call``'s collectives
    (it waits until rank 0 has its outcome, then leaves); rank 0 runs ``call`` and records how long it took
    and what happened ("returned", or the exception) for :func:`stalled_outcome`. Both leave the process
    at once, so neither waits on the stalled group."""
    path = os.path.join(out_dir, _OUTCOME)
    if rank == 1:
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(0)
    start = time.monotonic()
    try:
        call()
        outcome = "returned"
    except Exception as e:  # noqa: BLE001 - the error is the outcome under test
        outcome = f"{type(e).__name__}: {e}"
    with open(path, "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{outcome}")
    os._exit(0)


def stalled_outcome(out_dir) -> tuple[float, str]:
    """``(seconds, outcome)`` recorded by :func:`stall_rank_one` on rank 0."""
    with open(os.path.join(out_dir, _OUTCOME)) as f:
        elapsed, outcome = f.read().split("\n", 1)
    return float(elapsed), outcome
