"""Host cost of an optimizer step, per call and per parameter tensor, next to PyTorch's fused AdamW.

    python benchmarks/host/bench_optimizer_host.py                  # every row, 100 / 1,000 / 10,000 tensors
    python benchmarks/host/bench_optimizer_host.py -k Adam --sizes 1000 --json host.json
    python benchmarks/run.py -k host                                # the FusedAdam rows, in run.py's table

Every optimizer's Triton path runs on CPU tensors with the kernel launches replaced by no-ops at the
launcher boundary (``JITFunction.run`` / ``InterpretedFunction.run`` return at once; everything before the
launch runs: the step's checks and bookkeeping, the op's dispatch, the engine's grouping and tables), and
PyTorch's ``torch.optim.AdamW(fused=True)`` with ``torch._fused_adamw_`` stubbed the same way. So the time is
the host's work alone. Tensors are 16 elements (the host's work does not depend on the size). A time is the
minimum over repeats of the mean of a loop of calls, in the calling thread's CPU time (``time.thread_time``:
on a shared machine, other processes' work does not count), each row interleaved with the reference.

Rows: each apex optimizer after its first step (the gradients the same tensors every step, as with
``zero_grad(set_to_none=False)``); the rows ``..., new gradients`` give it new gradient tensors every step
(``zero_grad(set_to_none=True)`` and a backward; the allocation itself is not counted); the ``amp_C`` ops
called with new Python lists of the same tensors every call; amp's in-place unscale of the gradients.

What a CPU cannot show: the GPU-only work of a launch (Triton's own launcher, ~10-20 µs a launch, a constant
per step), the upload of a table when the gradients' addresses changed (pinned, not blocking), and
``multi_tensor_l2norm``'s copy of its per-tensor bounds to the GPU (LAMB, LARS: blocking).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZES = (100, 1000, 10000)


@contextlib.contextmanager
def stubbed():
    """Triton launches and PyTorch's fused Adam kernels return at once; apex takes its Triton path on CPU
    tensors (as ``apex.testing.triton_compile`` lets it, without the interpreter)."""
    import apex
    from apex import _backend
    from benchmarks.host._stub import stubbed_launches

    with stubbed_launches(torch_fused_adam=True), _backend.compile_only_mode(), apex.backend("triton"):
        yield


def _params(n: int, dtype=None):
    import torch

    params = [torch.nn.Parameter(torch.zeros(16, dtype=dtype or torch.float32)) for _ in range(n)]
    for p in params:
        p.grad = torch.zeros_like(p)
    return params


def _optimizer(name: str) -> Callable:
    import torch

    from apex import optimizers as o

    return {
        "FusedAdam": lambda ps: o.FusedAdam(ps, lr=1e-3, weight_decay=0.01),
        "FusedAdam capturable, bf16 + masters": lambda ps: o.FusedAdam(ps, lr=1e-3, weight_decay=0.01,
                                                                       capturable=True, master_weights=True),
        "FusedSGD (momentum)": lambda ps: o.FusedSGD(ps, lr=0.1, momentum=0.9),
        "FusedAdagrad": lambda ps: o.FusedAdagrad(ps, lr=0.1),
        "FusedLAMB": lambda ps: o.FusedLAMB(ps, lr=1e-3),
        "FusedNovoGrad": lambda ps: o.FusedNovoGrad(ps, lr=1e-3),
        "FusedLARS (momentum)": lambda ps: o.FusedLARS(ps, lr=0.1, momentum=0.9),
        "FusedMixedPrecisionLamb, bf16": lambda ps: o.FusedMixedPrecisionLamb(
            ps, lr=1e-3, reduced_precision_dtype=torch.bfloat16),
    }[name.removesuffix(NEW_GRADS)]


NEW_GRADS = ", new gradients"
OPTIMIZER_ROWS = ("FusedAdam", "FusedAdam" + NEW_GRADS, "FusedAdam capturable, bf16 + masters",
                  "FusedSGD (momentum)", "FusedSGD (momentum)" + NEW_GRADS, "FusedAdagrad", "FusedLAMB",
                  "FusedLAMB" + NEW_GRADS, "FusedNovoGrad", "FusedLARS (momentum)", "FusedMixedPrecisionLamb, bf16",
                  "FusedMixedPrecisionLamb, bf16" + NEW_GRADS)
OP_ROWS = ("amp_C.multi_tensor_scale, new lists", "amp_C.multi_tensor_l2norm, new lists",
           "amp LossScaler.unscale (in place)")
REFERENCE = "torch.optim.AdamW(fused=True)"


def build(name: str, n: int, new_grads: bool = False) -> tuple[Callable, Callable | None]:
    """``(call, setup)``: one call of the row with ``n`` tensors; ``setup`` (or None) runs before each call
    and is not timed. ``new_grads``: the reference gets new gradient tensors before each step too."""
    import torch

    if name in OPTIMIZER_ROWS or name == REFERENCE:
        params = _params(n, torch.bfloat16 if "bf16" in name else None)
        opt = (torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True) if name == REFERENCE
               else _optimizer(name)(params))
        if new_grads or name.endswith(NEW_GRADS):

            def renew():
                for p in params:
                    p.grad = torch.zeros_like(p)

            return opt.step, renew
        return opt.step, None
    import amp_C

    tensors = [p.detach() for p in _params(n)]
    flag = torch.zeros(1, dtype=torch.int32)
    if name.startswith("amp_C.multi_tensor_scale"):
        outs = [torch.zeros_like(t) for t in tensors]
        return (lambda: amp_C.multi_tensor_scale(65536, flag, [list(tensors), list(outs)], 0.5)), None
    if name.startswith("amp_C.multi_tensor_l2norm"):
        return (lambda: amp_C.multi_tensor_l2norm(65536, flag, [list(tensors)], True)), None
    from apex.amp.scaler import LossScaler

    scaler = LossScaler("dynamic")
    return (lambda: scaler.unscale(tensors, tensors, None, models_are_masters=True)), None


def _loop(call: Callable, setup: Callable | None, reps: int) -> float:
    """Mean thread CPU seconds of ``call`` over ``reps`` calls (``setup`` before each, not counted)."""
    total = 0.0
    if setup is None:
        t0 = time.thread_time()
        for _ in range(reps):
            call()
        return (time.thread_time() - t0) / reps
    for _ in range(reps):
        setup()
        t0 = time.thread_time()
        call()
        total += time.thread_time() - t0
    return total / reps


def measure_pair(ours: tuple, theirs: tuple, n: int, repeats: int = 7) -> tuple[float, float]:
    """Microseconds per call of two rows, interleaved; the minimum over ``repeats`` of each loop's mean."""
    reps = max(3, 20000 // max(n, 1))
    for call, setup in (ours, theirs):  # warm-up: the first steps plan and build their tables
        for _ in range(3):
            if setup is not None:
                setup()
            call()
    best = [float("inf"), float("inf")]
    for i in range(repeats):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            call, setup = (ours, theirs)[which]
            best[which] = min(best[which], _loop(call, setup, reps))
    return best[0] * 1e6, best[1] * 1e6


def run(names, sizes) -> list[dict]:
    rows = []
    for name in names:
        row: dict = {"name": name}
        for n in sizes:
            with stubbed():
                ours, ref = build(name, n), build(REFERENCE, n, new_grads=name.endswith(NEW_GRADS))
                us, ref_us = measure_pair(ours, ref, n)
            row[n] = {"us_per_call": us, "us_per_param": us / n, "torch_us_per_call": ref_us,
                      "torch_us_per_param": ref_us / n}
            del ours, ref
        print(f"  {name}: " + ", ".join(f"{n}: {row[n]['us_per_param']:.2f} µs/param" for n in sizes),
              file=sys.stderr, flush=True)
        rows.append(row)
    return rows



def format_table(rows: list[dict], sizes) -> str:
    """µs per call / **µs per tensor** of each row, and of PyTorch's fused AdamW measured with it."""
    head = ["host µs per call / per tensor"] + [f"{n:,} tensors" for n in sizes] + \
        [f"AdamW(fused), {n:,}" for n in sizes]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for row in rows:
        cells = [row["name"]] + [f"{row[n]['us_per_call']:,.0f} / **{row[n]['us_per_param']:.2f}**" for n in sizes]
        cells += [f"{row[n]['torch_us_per_call']:,.0f} / {row[n]['torch_us_per_param']:.2f}" for n in sizes]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cases() -> list:
    """For ``benchmarks/run.py``: FusedAdam's stubbed step against PyTorch's fused AdamW's, per size."""
    from benchmarks._harness import Case

    def timed(n: int):
        def make():
            ours, ref = build("FusedAdam", n), build(REFERENCE, n)

            def stub(fn):
                def call():
                    with stubbed():
                        fn()
                return call

            with stubbed():  # the first steps plan and build the tables
                for _ in range(2):
                    ours[0]()
                    ref[0]()
            return stub(ours[0]), stub(ref[0]), {"tensors": n, "launches": "stubbed (host time only)"}
        return make

    return [Case(f"host: FusedAdam step, {n:,} tensors (launches stubbed)", timed=timed(n),
                 torch_label="AdamW(fused), _fused_adamw_ stubbed", repeats=9)
            for n in SIZES]


def machine() -> str:
    from benchmarks._harness import machine as describe  # (torch imported only when a run starts)

    return describe()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-k", default="", help="only rows whose name contains this text")
    p.add_argument("--sizes", default=",".join(map(str, SIZES)), help="numbers of tensors (comma separated)")
    p.add_argument("--json", type=Path, help="write the figures to this file")
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    names = [n for n in OPTIMIZER_ROWS + OP_ROWS if args.k in n]
    print(f"{machine()}; apex's Triton path and PyTorch's fused AdamW with launches stubbed", file=sys.stderr)
    rows = run(names, sizes)
    print(format_table(rows, sizes))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
