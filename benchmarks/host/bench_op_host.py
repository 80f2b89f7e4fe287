"""Host cost per call of every fused op's Triton path, next to a plain ``autograd.Function``.

    python benchmarks/host/bench_op_host.py                 # every op, a markdown table on stdout
    python benchmarks/host/bench_op_host.py -k norm --json host.json

The Triton path runs on CPU tensors with every launch replaced by a no-op (``benchmarks/host/_stub.py``:
the launcher's own Python runs, ``kernel[grid](...)`` returns at once), so what is timed is the host's work
alone: argument checks, backend selection, dispatch, autograd, allocations, the launchers' configuration and
grid. Each op is called through its public entry (the module or function a model uses) at a small shape, so
the few PyTorch operators a path runs besides its kernels cost about their dispatch, as they would on a GPU.

Per op: microseconds per call of the forward under ``no_grad`` and of forward + backward
(``torch.autograd.grad``), the Triton launches each makes, and the same for ``plain``, an
``autograd.Function`` that allocates its output and launches one (stubbed) Triton kernel each way: what
Liger-Kernel's ops do, and the floor of an op written that way. ``plain`` has one input, one output, one
allocation and one launch each way; most ops have more of each, which no implementation avoids. So each op
also gets its ``same-job`` reference (:func:`_same_job`): a plain ``autograd.Function`` with the op's own
differentiable inputs, output, buffer allocations and launches each way (counted on a warm call of the op),
and no checks, backend choice or dispatch: the floor of this job written the Liger way. ``fwd+bwd ÷
same-job`` is the overhead of ours. An op whose public entry is an ``nn.Module`` (:data:`MODULE_ENTRIES`)
is also compared with the same reference called through a module (``same-job module``), as Liger-Kernel's
modules call their Functions: the module call is a cost of Apex's API, not of the implementation.
``liger`` rows (LayerNorm, RMSNorm) appear where Liger-Kernel is installed (``pip install -e ".[bench]"``).
Times are the minimum over repeats of the mean of a loop of calls (the thread's CPU time), ours and the
references interleaved: on a shared machine the minimum is the estimate
least disturbed by other work. Ratios are the median over repeats of ours ÷ the reference's loop timed next
to it, which follows a drifting load better than a ratio of two minima.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The ops timed (OPS, MODULE_ENTRIES, OUTPUTS: importable from here too).
from benchmarks.host._op_cases import MODULE_ENTRIES, OPS, OUTPUTS, M, N, _liger, _randn  # noqa: E402


def cases() -> list:
    """No cases for ``benchmarks/run.py``: this suite stubs the launches and runs on its own (see above)."""
    return []


# ------------------------------------------------------------------------------------------ the reference
def _plain_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _scale_rows(X, Y, W, n, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(X + row * stride + cols, mask=mask)
        tl.store(Y + row * stride + cols, x * tl.load(W + cols, mask=mask), mask=mask)

    return _scale_rows


def _plain():
    """A plain ``autograd.Function``: output allocated, one Triton launch forward, one backward."""
    import torch
    import triton

    _scale_rows = _plain_kernel()

    class Plain(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            y = torch.empty_like(x)
            n = x.shape[-1]
            _scale_rows[(x.numel() // n,)](x, y, w, n, n, BLOCK=triton.next_power_of_2(n))
            ctx.save_for_backward(w)
            return y

        @staticmethod
        def backward(ctx, dy):
            (w,) = ctx.saved_tensors
            dx = torch.empty_like(dy)
            n = dy.shape[-1]
            _scale_rows[(dy.numel() // n,)](dy, dx, w, n, n, BLOCK=triton.next_power_of_2(n))
            return dx, None

    return Plain


_ALLOCATORS = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
               "full_like")
_TENSOR_ALLOCATORS = ("new_empty", "new_zeros", "new_ones", "new_full")


@contextlib.contextmanager
def _counting_allocations() -> Iterator[list]:
    """Counts the buffer allocations (``torch.empty`` and its kin, from Python) made in the block: the
    outputs, statistics, partial sums and gradients an op's kernels write. Operators that allocate as a side
    effect (``.to``, ``.sum``, ``torch.cat``) are not counted: they are the implementation's choice, not the
    job's. (A ``TorchFunctionMode`` would not see the backward, which autograd's engine runs without it.)"""
    import torch

    count = [0]

    def counted(fn):
        def wrapper(*args, **kwargs):
            count[0] += 1
            return fn(*args, **kwargs)
        return wrapper

    saved = [(torch, n, getattr(torch, n)) for n in _ALLOCATORS]
    saved += [(torch.Tensor, n, getattr(torch.Tensor, n)) for n in _TENSOR_ALLOCATORS]
    for owner, name, fn in saved:
        setattr(owner, name, counted(fn))
    try:
        yield count
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _same_job(inputs: tuple, out, fwd: tuple[int, int], bwd: tuple[int, int], n_out: int = 1):
    """The floor of one op's job written the plain way: an ``autograd.Function`` taking the op's
    differentiable ``inputs`` and returning a tensor like ``out``, making the op's ``(allocations,
    launches)`` in its forward (``fwd``, the output among the allocations) and in its backward (``bwd``, one
    gradient per input among them), and nothing else: no checks, no backend choice, no dispatch. What a call
    of ours costs beyond this is overhead of ours; the rest is the job's (inputs, outputs, buffers, launches).
    ``n_out``: the op's outputs (:data:`OUTPUTS`; the timed call differentiates the first): the others are
    returned too, each one of the forward's allocations, with no gradient materialised for them, as ours."""
    import torch

    kernel = _plain_kernel()
    n_in, (fwd_allocs, fwd_launches), (bwd_allocs, bwd_launches) = len(inputs), fwd, bwd
    shape, dtype = out.shape, out.dtype

    class SameJob(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            x = xs[0]
            y = torch.empty(shape, dtype=dtype)
            extra = [torch.empty(shape, dtype=dtype) for _ in range(n_out - 1)]
            scratch = [torch.empty(16) for _ in range(fwd_allocs - n_out)]
            for _ in range(fwd_launches):
                kernel[(16,)](x, y, x, 16, 16, BLOCK=16)
            ctx.save_for_backward(*xs, *scratch)
            if extra:
                ctx.set_materialize_grads(False)
                return (y, *extra)
            return y

        @staticmethod
        def backward(ctx, dy, *_):
            saved = ctx.saved_tensors
            grads = tuple(torch.empty_like(t) for t in saved[:n_in])
            scratch = [torch.empty(16) for _ in range(bwd_allocs - n_in)]
            for _ in range(bwd_launches):
                kernel[(16,)](dy, grads[0], dy, 16, 16, BLOCK=16)
            del scratch
            return grads

    return SameJob


# -------------------------------------------------------------------------------------------------- timing
def _per_call(fn: Callable[[], object], calls: int) -> float:
    # The calling thread's CPU time, not the wall clock: on a shared machine the time this process waits for
    # a core is not host cost. Everything timed here runs on this thread (a CPU autograd backward too).
    t0 = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - t0) / calls * 1e6


def _workloads(call: Callable, inputs: tuple | None):
    """(forward under no_grad, forward + backward) callables of one op (None for an op without autograd)."""
    import torch

    if inputs is None:  # an op without autograd (an in-place accumulation)
        def fwd():
            call()
        return fwd, None
    with torch.no_grad():
        out = call()
    dy = torch.ones_like(out)

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        torch.autograd.grad(call(), inputs, dy)

    return fwd, fwd_bwd


def _job(call: Callable, inputs: tuple | None, stub) -> dict:
    """What one call of an op does, counted on a warm call: ``(allocations, launches)`` of its forward under
    no_grad, of its forward with gradients, and of its backward."""
    import torch

    def count(fn):
        before = stub.launches
        with _counting_allocations() as allocations:
            result = fn()
        return result, (allocations[0], stub.launches - before)

    job = {}
    with torch.no_grad():
        call()
        _, job["fwd"] = count(call)
    if inputs is not None:
        out = call()
        torch.autograd.grad(out, inputs, torch.ones_like(out))
        out, job["fwd_grad"] = count(call)
        dy = torch.ones_like(out)
        _, job["bwd"] = count(lambda: torch.autograd.grad(out, inputs, dy))
        job["out"] = out.detach()
    return job


def _reference_workloads(inputs: tuple | None, job: dict, module: bool = False, n_out: int = 1):
    """(forward, forward + backward) of the op's same-job reference (:func:`_same_job`); ``module``: called
    through an ``nn.Module`` whose ``forward`` applies it, as an op whose public entry is a module is (and as
    Liger-Kernel's modules call their Functions)."""
    if inputs is None:
        return None, None
    import torch

    xs = tuple(t.detach().requires_grad_() for t in inputs)
    # The no_grad forward mirrors the op's no_grad forward (which may skip saving statistics).
    fwd_fn = _same_job(xs, job["out"], job["fwd"], (0, 0), n_out).apply
    fb_fn = _same_job(xs, job["out"], job["fwd_grad"], job["bwd"], n_out).apply
    if n_out > 1:  # the first output, as the op's timed call takes it
        fwd_fn, fb_fn = (lambda *a, f=fwd_fn: f(*a)[0]), (lambda *a, f=fb_fn: f(*a)[0])
    if module:
        fwd_fn, fb_fn = _module_calling(fwd_fn), _module_calling(fb_fn)
    dy = torch.ones_like(job["out"])

    def fwd():
        with torch.no_grad():
            fwd_fn(*xs)

    def fwd_bwd():
        torch.autograd.grad(fb_fn(*xs), xs, dy)

    return fwd, fwd_bwd


def _module_calling(apply: Callable):
    import torch

    class SameJobModule(torch.nn.Module):
        def forward(self, *xs):
            return apply(*xs)

    return SameJobModule()


def measure(names: list[str], calls: int, repeats: int) -> list[dict]:
    import torch

    import apex
    from benchmarks.host._stub import stubbed_launches

    plain = _plain()
    w = torch.randn(N)
    rows = []
    with apex.backend("triton"), stubbed_launches() as stub:
        ref_x = _randn(M, N)
        plain_ref = _workloads(lambda: plain.apply(ref_x, w), (ref_x,))
        builders = {name: OPS[name] for name in names}
        if importlib.util.find_spec("liger_kernel") is not None:
            builders.update({"liger LayerNorm": _liger("layer"), "liger RMSNorm": _liger("rms")})
        for name, build in builders.items():
            try:
                call, inputs = build()
                ours = _workloads(call, inputs)
                job = _job(call, inputs, stub)
            except Exception as exc:  # an op whose entry fails here is reported, not fatal
                rows.append({"op": name, "error": f"{type(exc).__name__}: {exc}"[:160]})
                continue
            n_out = OUTPUTS.get(name, 1)
            same = _reference_workloads(inputs, job, n_out=n_out)
            in_module = (_reference_workloads(inputs, job, module=True, n_out=n_out) if name in MODULE_ENTRIES
                         else (None, None))
            row = {"op": name, "fwd_launches": job["fwd"][1], "fwd_allocs": job["fwd"][0]}
            if "bwd" in job:
                row["fwd_bwd_launches"] = job["fwd_grad"][1] + job["bwd"][1]
                row["fwd_bwd_allocs"] = job["fwd_grad"][0] + job["bwd"][0]
            for i, label in enumerate(("fwd", "fwd_bwd")):
                fns = {"": ours[i], "plain_": plain_ref[i], "job_": same[i], "mjob_": in_module[i]}
                fns = {k: f for k, f in fns.items() if f is not None}
                if "" not in fns:
                    continue
                for _ in range(3):  # warm caches (launch configurations, autograd)
                    for fn in fns.values():
                        fn()
                times: dict = {key: [] for key in fns}
                for _ in range(repeats):  # interleaved: a burst of other work on the machine hits all alike
                    for key, fn in fns.items():
                        times[key].append(_per_call(fn, calls))
                for key, values in times.items():
                    row[f"{key}{label}_us"] = round(min(values), 1)
                    if key:
                        # The ratio of each loop of ours to the reference's loop next to it, median over the
                        # repeats: steadier than a ratio of minima when the machine's load drifts.
                        ratios = sorted(o / r for o, r in zip(times[""], values))
                        row[f"{label}_per_{key[:-1]}"] = round(ratios[len(ratios) // 2], 3)
            rows.append(row)
    return rows



def _ratio(r: dict, label: str, ref: str) -> str:
    value = r.get(f"{label}_per_{ref}")
    return f"{value:.2f}" if value is not None else "-"


def table(rows: list[dict]) -> str:
    lines = ["| op | launches fwd / fwd+bwd | allocations fwd / fwd+bwd | fwd µs | fwd+bwd µs | plain fwd+bwd µs "
             "| same-job fwd / fwd+bwd µs | fwd+bwd ÷ plain | fwd ÷ same-job | fwd+bwd ÷ same-job "
             "| fwd+bwd ÷ same-job module |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r['error']} | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['op']} | {r['fwd_launches']} / {r.get('fwd_bwd_launches', '-')} | {r['fwd_allocs']} / "
            f"{r.get('fwd_bwd_allocs', '-')} | {r['fwd_us']} | {r.get('fwd_bwd_us', '-')} | "
            f"{r.get('plain_fwd_bwd_us', '-')} | {r.get('job_fwd_us', '-')} / {r.get('job_fwd_bwd_us', '-')} | "
            f"{_ratio(r, 'fwd_bwd', 'plain')} | {_ratio(r, 'fwd', 'job')} | **{_ratio(r, 'fwd_bwd', 'job')}** | "
            f"{_ratio(r, 'fwd_bwd', 'mjob')} |")
    return "\n".join(lines)


def machine() -> str:
    from benchmarks._harness import machine as describe  # (torch imported only when a run starts)

    return describe()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the ops whose name contains this (case-insensitive)")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--repeats", type=int, default=7, help="timed loops per op and side (minimum kept)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    # The interpreter lets the Triton path run on CPU tensors; it must be on before a kernel module is imported.
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)
    names = [n for n in OPS if args.k.lower() in n.lower()]
    rows = measure(names, args.calls, args.repeats)
    print(f"Machine: {machine()}.\n")
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
