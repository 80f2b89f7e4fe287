"""Host cost of DistributedFusedAdam / DistributedFusedLAMB, per call and per parameter tensor, next to DDP +
FusedAdam.

    python benchmarks/host/bench_distributed_optimizer_host.py                # 100 / 1,000 / 10,000 tensors
    python benchmarks/host/bench_distributed_optimizer_host.py -k LAMB --sizes 1000 --json dist_host.json

One process, a Gloo process group of world size 1 (a ``FileStore`` in a temporary directory, destroyed at the
end), CPU tensors of 16 elements, every Triton launch replaced by a no-op (``bench_optimizer_host.stubbed``),
so that only the host's work is timed. Each repeat runs training iterations ``zero_grad(); forward;
backward; step()`` and times three parts of each, in the calling thread's CPU time:

* ``step``: ``optimizer.step()`` after the first steps (the reduction's wait, the sharded update, the
  parameter all-gather and its copy back into the model);
* ``hooks``: the backward's time minus that of the same backward on a model without an optimizer: what
  the per-parameter gradient hooks cost (apex's Python hooks; DDP's reducer, in C++, for the reference);
* ``zero_grad``: ``optimizer.zero_grad()``.

The forward is ``torch.cat`` of the parameters (flattened), summed: one autograd node for all of them, so
that the backward's own work is an accumulation per parameter. A time is the minimum over repeats of the
mean of a loop. With one rank no collective leaves the process (the reduce-scatter and all-gather of a
world of one are local), so the figures are the per-tensor Python of the optimizers, not the network's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.host.bench_optimizer_host import machine, stubbed  # noqa: E402

SIZES = (100, 1000, 10000)
ROWS = ("DistributedFusedAdam", "DistributedFusedLAMB")
REFERENCE = "DDP + FusedAdam"
PARTS = ("step", "hooks", "zero_grad")


@contextlib.contextmanager
def process_group():
    """A Gloo group of one rank for the block (none may exist before)."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _model(n: int):
    """``n`` parameters of 16 elements and a forward that uses each once (one autograd node)."""
    import torch

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16)) for _ in range(n)])

        def forward(self, *unused):
            return torch.cat([p.view(-1) for p in self.ps]).sum()

    return Model()


def build(name: str, n: int):
    """``(forward, zero_grad, step)`` of a row with ``n`` tensors; forward returns the loss."""
    import torch

    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
    from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB
    from apex.optimizers import FusedAdam

    model = _model(n)
    params = list(model.parameters())
    if name == "DistributedFusedAdam":
        opt = DistributedFusedAdam(params, lr=1e-3, weight_decay=0.01)
        return model.forward, opt.zero_grad, opt.step
    if name == "DistributedFusedLAMB":
        opt = DistributedFusedLAMB(params, lr=1e-3, weight_decay=0.01)
        return model.forward, opt.zero_grad, opt.step
    if name == REFERENCE:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = FusedAdam(params, lr=1e-3, weight_decay=0.01)
        return ddp, opt.zero_grad, opt.step
    if name == "no optimizer":
        return model.forward, lambda: [setattr(p, "grad", None) for p in params], lambda: None
    raise KeyError(name)


def _cycle(row, reps: int) -> dict:
    """Mean thread CPU seconds of each part over ``reps`` iterations."""
    forward, zero_grad, step = row
    total = dict.fromkeys(PARTS, 0.0)
    for _ in range(reps):
        t0 = time.thread_time()
        zero_grad()
        t1 = time.thread_time()
        loss = forward()
        t2 = time.thread_time()
        loss.backward()
        t3 = time.thread_time()
        step()
        t4 = time.thread_time()
        total["zero_grad"] += t1 - t0
        total["hooks"] += t3 - t2
        total["step"] += t4 - t3
    return {k: v / reps for k, v in total.items()}


def measure(names, n: int, repeats: int = 5) -> dict:
    """µs per call of each part of each row (and of the plain backward, subtracted from ``hooks``)."""
    rows = {name: build(name, n) for name in (*names, "no optimizer")}
    reps = max(3, 5000 // n)
    for row in rows.values():  # the first steps place the parameters and plan the copies
        _cycle(row, 3)
    best = {name: dict.fromkeys(PARTS, float("inf")) for name in rows}
    for i in range(repeats):
        for name in (list(rows) if i % 2 == 0 else list(rows)[::-1]):
            for part, t in _cycle(rows[name], reps).items():
                best[name][part] = min(best[name][part], t)
    plain = best.pop("no optimizer")["hooks"]
    out = {}
    for name, parts in best.items():
        parts["hooks"] = max(parts["hooks"] - plain, 0.0)
        out[name] = {part: t * 1e6 for part, t in parts.items()}
    out["backward without hooks"] = plain * 1e6
    return out


def run(names, sizes) -> dict:
    results = {}
    # DistributedFusedAdam's default 100 MB buckets hold these small models many times over: its warning of
    # unused bucket space says so at every size
    with process_group(), stubbed(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Only .* of buckets are used")
        for n in sizes:
            results[n] = measure(names, n)
            print(f"  {n} tensors: " + ", ".join(
                f"{name} step {r['step'] / n:.2f}, hooks {r['hooks'] / n:.2f}, zero_grad {r['zero_grad'] / n:.2f}"
                for name, r in results[n].items() if isinstance(r, dict)) + " µs/tensor", file=sys.stderr, flush=True)
    return results


def format_table(results: dict, names, sizes) -> str:
    """µs per call / **µs per tensor** of each row's parts."""
    head = ["host µs per call / per tensor"] + [f"{n:,} tensors" for n in sizes]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for name in names:
        for part in PARTS:
            cells = [f"{name}: {part}"] + [f"{results[n][name][part]:,.0f} / **{results[n][name][part] / n:.2f}**"
                                           for n in sizes]
            lines.append("| " + " | ".join(cells) + " |")
    cells = ["(backward without hooks)"] + [f"{results[n]['backward without hooks']:,.0f} / "
                                            f"{results[n]['backward without hooks'] / n:.2f}" for n in sizes]
    lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cases() -> list:
    """None for ``benchmarks/run.py``: this suite needs a process group in the calling process, which run.py's
    other cases do not expect; run it on its own (see the module docstring)."""
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", default="", help="only rows whose name contains this text")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="numbers of tensors (comma separated)")
    p.add_argument("--json", type=Path, help="write the figures to this file")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [n for n in ROWS if args.k in n] + [REFERENCE]
    print(f"{machine()}; one Gloo rank, launches stubbed", file=sys.stderr)
    results = run(names, sizes)
    print(format_table(results, names, sizes))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
