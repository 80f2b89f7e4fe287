"""Helpers shared by the example scripts: command-line options, torchrun set-up, checkpoints, tables, plots,
memory, checksums.

The examples import this file as a sibling module (``examples/`` is on ``sys.path`` when a script in it
runs), so each example stays a plain script that ``python`` or ``torchrun`` can start directly.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import resource
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, unreadable or does not match the run that tries to resume from it."""


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if requested == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda was requested but no CUDA/ROCm GPU is available")
    return torch.device(requested)


def setup_distributed(requested_device: str, timeout_s: float) -> DistInfo:
    """Join the process group when started by ``torchrun`` (Gloo on CPU, NCCL on GPUs).

    ``timeout_s`` bounds every collective: if one rank dies or hangs, the others fail with PyTorch's
    timeout error after that many seconds instead of waiting forever.
    """
    device = pick_device(requested_device)
    if not launched_by_torchrun():
        return DistInfo(device=device)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world_size, local_rank, device)


def cleanup_distributed(info: DistInfo, ok: bool = True) -> None:
    """Leave the process group together: a rank that tears Gloo down while a peer still uses its
    connections can make that peer abort. After an error, skip the barrier (the peers may never reach it)."""
    if info.distributed and dist.is_initialized():
        if ok:
            dist.barrier()
        dist.destroy_process_group()


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, except where its help already says it (a default that depends
    on other options) or there is none to show (``None``, an off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_runtime_args(group) -> None:
    """``--device``, ``--threads`` and ``--dist-timeout`` on an argparse parser or argument group."""
    group.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                       help="where to train (auto: the GPU when PyTorch sees a CUDA/ROCm one, else the CPU)")
    group.add_argument("--threads", type=int, default=0,
                       help="CPU threads per rank (0: the idle cores, split among the local ranks)")
    group.add_argument("--dist-timeout", type=float, default=120.0,
                       help="seconds before a collective waiting on a dead or hung rank fails")


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: Sequence[str]) -> None:
    """Exit through ``parser.error`` naming the first option in ``names`` that is not positive."""
    for name in names:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")


def set_cpu_threads(requested: int, info: DistInfo) -> int:
    """Use the requested thread count, or this rank's share of the cores that are idle.

    Idle matters: on a machine that other processes keep busy, OpenMP threads that outnumber the free cores
    wait on each other at every parallel region, and 2 threads on 2 busy cores measured ~2x slower than 1.
    """
    if requested > 0:
        n = requested
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        local_world = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size)))
        busy = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        idle = max(1, cores - round(busy)) if local_world == 1 else cores
        n = max(1, min(cores, idle) // local_world)
    torch.set_num_threads(n)
    return n


def peak_memory_mib(device: torch.device) -> tuple[float, str]:
    """Peak memory of this process: GPU allocator peak on CUDA, peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "GPU allocated"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    if sys.platform == "darwin":  # bytes on macOS
        rss_kib /= 1024
    return rss_kib / 1024, "process RSS"


def param_checksum(model: torch.nn.Module) -> str:
    """SHA-256 (first 16 hex digits) over every parameter's bytes, in a fixed order."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().float().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def gather_checksums(model: torch.nn.Module, info: DistInfo) -> list[str]:
    mine = param_checksum(model)
    if not info.distributed:
        return [mine]
    out: list[str | None] = [None] * info.world_size
    dist.all_gather_object(out, mine)
    return [str(c) for c in out]


def format_table(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = "+-" + "-+-".join("-" * w for w in widths) + "-+"
    fmt = lambda r: "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, widths))) + " |"
    return "\n".join([line, fmt(cells[0]), line, *(fmt(r) for r in cells[1:]), line])


# ----------------------------------------------------------------------------------------------------------
# Checkpoints: written atomically, and read back with errors that say what is wrong and where.

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(directory: str | os.PathLike, state: dict) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_NAME
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash while saving never leaves a half-written checkpoint behind
    return path


def load_checkpoint(directory: str | os.PathLike, required: Sequence[str]) -> dict:
    directory = Path(directory)
    path = directory / CHECKPOINT_NAME if directory.is_dir() or not directory.suffix else directory
    if not path.exists():
        where = f"directory {directory} does not exist" if not directory.exists() else f"{path} is missing"
        raise CheckpointError(f"cannot resume: no checkpoint found ({where}). Start a run with "
                              f"--save {directory} first, or drop --resume to train from scratch.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # torch.load raises many types for truncated or foreign files
        raise CheckpointError(f"cannot resume: checkpoint {path} is corrupt or unreadable "
                              f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"cannot resume: {path} does not hold a checkpoint dictionary "
                              f"(found {type(state).__name__})")
    missing = [k for k in required if k not in state]
    if missing:
        raise CheckpointError(f"cannot resume: checkpoint {path} lacks the entries {missing}")
    return state


# ----------------------------------------------------------------------------------------------------------
# Plots (matplotlib without a display).


def ema(values: Sequence[float], alpha: float | None = None) -> list[float]:
    """Bias-corrected exponential moving average (as Adam corrects its moments): the ``t``-th value is
    ``sum_i alpha (1-alpha)^(t-i) v_i / (1 - (1-alpha)^t)``, a weighted mean of the values so far.

    Seeding the average with the first value instead gives that value a weight of ``(1-alpha)^(t-1)``
    (0.39 after 10 steps), so on a short run, where the loss falls fast from ln(256), the curve lags far
    above the validation points and reads as overfitting. The default ``alpha`` keeps the lag (about
    ``1/alpha`` steps) under a twentieth of the run: 0.1 for runs of 200 steps or more, up to 0.5.
    """
    if alpha is None:
        alpha = max(0.1, min(0.5, 20 / max(1, len(values))))
    out, acc, weight = [], 0.0, 0.0
    for v in values:
        acc = (1 - alpha) * acc + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(acc / weight)
    return out


def plot_losses(path: str | os.PathLike, runs: dict[str, dict], title: str) -> Path:
    """``runs`` maps a label to ``{"train": [(step, loss)...], "val": [(step, loss)...]}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for color, (label, h) in zip(colors, runs.items()):
        if h["train"]:
            s, v = zip(*h["train"])
            ax.plot(s, v, color=color, alpha=0.2, linewidth=0.8)
            ax.plot(s, ema(v), color=color, linewidth=1.2, label=f"{label} train (EMA)")
        if h["val"]:
            s, v = zip(*h["val"])
            ax.plot(s, v, color=color, marker="o", markersize=3, linestyle="--", label=f"{label} validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
