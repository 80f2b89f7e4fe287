"""Running a CPU multi-tensor step block by block, over all the cores.

Two things make a step of several ``torch._foreach_*`` passes slow on a CPU when it has many tensors:

* each pass streams every list through memory again;
* PyTorch's CPU kernels split one tensor over the intra-op threads only above about 32K elements
  (``at::internal::GRAIN_SIZE``), and ``torch._foreach_*`` handles its tensors one after another, so a
  list of small tensors runs on one core.

``blocks`` cuts the lists into consecutive blocks of about ``BLOCK_ELEMENTS`` elements, small enough to
stay in the cache from one pass to the next; ``run`` applies the passes to one block at a time, handing
the blocks of small tensors to worker threads (one per intra-op thread, each running PyTorch
single-threaded so the cores are not oversubscribed) and running a block holding one large tensor on the
calling thread, whose kernels already use every core. Each tensor sees the same operations as unblocked,
in the same order; only the summation order inside a norm of a tensor above 32K elements may differ
from a multi-threaded run (it is the same from run to run). Cross-tensor reductions (a global norm) stay
outside ``run``.

The workers are daemon threads started on first use (again in a forked child, which inherits no
threads); they run each task in the caller's grad mode (which is per thread). ``APEX_CPU_WORKERS`` sets
their number (``0`` or ``1``: everything on the calling thread). Passes that only stream memory gain
nothing from a second core on a machine whose bandwidth one core saturates; they pass ``threads=False``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

# Elements per block: 1 MiB per fp32 list, so the four to six lists of a step stay in the cache between
# passes.
BLOCK_ELEMENTS = 1 << 18

_LOCAL = threading.local()


def blocks(tensors: Sequence[torch.Tensor], max_elements: int | None = None) -> list[list[int]]:
    """Consecutive index ranges of at most ``max_elements`` (default ``BLOCK_ELEMENTS``) elements each (a
    larger tensor is a block of its own). One block holding everything when the tensors are not on the
    CPU."""
    max_elements = BLOCK_ELEMENTS if max_elements is None else max_elements
    if not all(t.is_cpu for t in tensors):
        return [list(range(len(tensors)))]
    out: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        n = t.numel()
        if cur and size + n > max_elements:
            out.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        out.append(cur)
    return out


def workers() -> int:
    """How many worker threads ``run`` may use (0: none)."""
    env = os.environ.get("APEX_CPU_WORKERS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            n = -1
        if n < 0:
            raise ValueError(f"APEX_CPU_WORKERS must be a non-negative integer, got {env!r}")
    else:
        n = torch.get_num_threads()
    return n if n > 1 else 0


def run(fn: Callable, parts: list[list[int]], *lists: Sequence, threads: bool = True) -> list:
    """``fn(*[[lst[i] for i in part] for lst in lists])`` for each part; the results, in part order.

    With workers, the parts holding one tensor of at least ``BLOCK_ELEMENTS`` elements run first on the
    calling thread, then the others concurrently on the workers (part ``k`` of them on worker
    ``k mod n``, so the assignment is the same every call). ``threads=False``: all on the calling thread
    (for passes that only stream memory, where a second core adds no bandwidth)."""
    def pick(part):
        return tuple([lst[i] for i in part] for lst in lists)

    n = workers() if threads and len(parts) > 1 else 0
    if n == 0 or getattr(_LOCAL, "worker", False):
        return [fn(*pick(part)) for part in parts]
    results: list = [None] * len(parts)
    small = []
    for k, part in enumerate(parts):
        if len(part) == 1 and lists[0][part[0]].numel() >= BLOCK_ELEMENTS:
            results[k] = fn(*pick(part))
        else:
            small.append(k)
    if not small:
        return results
    n = min(n, len(small))
    pool = _POOL.get(n)
    shares = [small[i::n] for i in range(n)]
    grad = torch.is_grad_enabled()
    futures = [pool.submit(i, _run_share, (fn, [pick(parts[k]) for k in share], grad))
               for i, share in enumerate(shares)]
    errors = [f.exception() for f in futures]  # waits for every worker, even when one fails
    for e in errors:
        if e is not None:
            raise e
    for share, f in zip(shares, futures):
        for k, r in zip(share, f.result()):
            results[k] = r
    return results


def _run_share(fn: Callable, args_list: list, grad_enabled: bool) -> list:
    with torch.set_grad_enabled(grad_enabled):  # grad mode is per thread: take the caller's
        return [fn(*args) for args in args_list]


class _Workers:
    """Threads with a queue each, so that task ``i`` of a call always runs on worker ``i``."""

    def __init__(self, n: int):
        self.pid = os.getpid()
        self.queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(n)]
        ready = threading.Barrier(n + 1)
        for q in self.queues:
            threading.Thread(target=self._serve, args=(q, ready), daemon=True, name="apex-cpu-worker").start()
        ready.wait()
        # set_num_threads in a worker also changed the count that threads started later begin with;
        # put back this thread's count.
        torch.set_num_threads(torch.get_num_threads())

    @staticmethod
    def _serve(q: queue.SimpleQueue, ready: threading.Barrier) -> None:
        _LOCAL.worker = True
        torch.set_num_threads(1)
        # A thread takes its thread count from the process-wide one on its first parallel call;
        # get_num_threads makes that happen now, before the constructor restores the process-wide count.
        torch.get_num_threads()
        ready.wait()
        while True:
            fn, args, fut = q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # re-raised in the caller by run()
                fut.set_exception(exc)

    def submit(self, i: int, fn: Callable, args: tuple) -> Future:
        fut: Future = Future()
        self.queues[i].put((fn, args, fut))
        return fut


class _Pool:
    """The process's workers: created on first use, grown on demand, re-created after a fork."""

    def __init__(self):
        self._workers: _Workers | None = None
        self._lock = threading.Lock()

    def get(self, n: int) -> _Workers:
        with self._lock:
            w = self._workers
            if w is None or w.pid != os.getpid() or len(w.queues) < n:
                w = self._workers = _Workers(n)
            return w


_POOL = _Pool()
