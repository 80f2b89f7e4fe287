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

Creating a tensor object costs about a microsecond on the CPU, as much as the arithmetic of a tensor of a
few thousand elements, so a step over many small tensors must not create any per tensor.
``Workspace`` holds what a step can reuse: a ``Layout`` (the blocks, and inside each block its tensors
smallest first, so that tensors of one size lie side by side in a flat buffer and one 2-D view covers
them: ``class_norms`` takes all their norms in one call), flat fp32 buffers with views shaped like the
tensors, and per-tensor scalars with 0-dim views that ``torch._foreach_*`` ops take as a list.

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
from typing import TYPE_CHECKING, NamedTuple

import torch

from apex.ops._cpu_norms import ROW_ELEMENTS, row_norms

if TYPE_CHECKING:
    from apex.ops._cpu_packed import Packed

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


class Block(NamedTuple):
    """One block of a ``Layout``."""

    order: list[int]  # its tensors (indices into the list), smallest first
    start: int  # position of order[0] in Layout.perm
    offset: int  # where the block starts in a flat buffer laid out as Layout.perm
    numel: int
    classes: tuple[tuple[int, int, int, int], ...]  # (position in order, count, numel, offset in block)
    # The positions of the tensors that are alone in their class (and short enough for one norm call):
    # with the tensors' views at hand, ``class_norms`` norms them all in one ``torch._foreach_norm``.
    singles: tuple[int, ...] = ()
    single_index: torch.Tensor | None = None  # ``singles`` as int64, unless they are all the positions
    grouped: tuple[tuple[int, int, int, int], ...] = ()  # the other classes


class Layout:
    """The blocks of a list of tensors with ``sizes`` elements (as ``blocks``), each ordered smallest
    first. ``perm`` is the concatenation of the blocks' orders: the order of a flat buffer of the whole
    list, in which every run of same-sized tensors of a block (a class) is one 2-D view."""

    def __init__(self, sizes: Sequence[int], max_elements: int | None = None):
        self.sizes = tuple(int(n) for n in sizes)
        self.blocks: list[Block] = []
        self.perm: list[int] = []
        offset = 0
        for part in blocks([_Sized(n) for n in self.sizes], max_elements):
            order = sorted(part, key=lambda i: self.sizes[i])  # stable: equal sizes keep their order
            classes, j, at = [], 0, 0
            while j < len(order):
                n, k = self.sizes[order[j]], 1
                while j + k < len(order) and self.sizes[order[j + k]] == n:
                    k += 1
                classes.append((j, k, n, at))
                j, at = j + k, at + k * n
            self.blocks.append(_block(order, len(self.perm), offset, at, classes))
            self.perm.extend(order)
            offset += at
        self.numel = offset


def _block(order: list[int], start: int, offset: int, numel: int, classes: list) -> Block:
    alone = [c for c in classes if c[1] == 1 and 0 < c[2] <= ROW_ELEMENTS]
    if len(alone) < 2:  # nothing to gain from a foreach call
        alone = []
    singles = tuple(c[0] for c in alone)
    index = None if len(singles) in (0, len(order)) else torch.tensor(singles, dtype=torch.int64)
    grouped = tuple(c for c in classes if c not in alone)
    return Block(order, start, offset, numel, tuple(classes), singles, index, grouped)


class _Sized:
    """A stand-in with ``numel`` and ``is_cpu`` for ``blocks``."""

    __slots__ = ("n",)
    is_cpu = True

    def __init__(self, n: int):
        self.n = n

    def numel(self) -> int:
        return self.n


def scratch(n: int) -> torch.Tensor:
    """``n`` fp32 elements of this thread's scratch buffer (kept for the next call)."""
    buf = getattr(_LOCAL, "scratch", None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # kept: an ordinary tensor even when made in inference mode
            buf = _LOCAL.scratch = torch.empty(max(n, BLOCK_ELEMENTS), dtype=torch.float32)
    return buf[:n]


def class_norms(flat: torch.Tensor, block: Block, out: torch.Tensor, ord: float = 2.0,
                views: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """``out[j] = ‖tensor order[j]‖`` (fp32) for a block whose tensors lie in ``flat`` in its order: one
    ``vector_norm`` per class of same-sized tensors (``_cpu_norms.row_norms`` for long L2 rows). Given
    ``views`` (the tensors' views of ``flat``, in block order), the tensors alone in their class are normed
    by one ``torch._foreach_norm``: a Python loop over them would hold the interpreter lock that the other
    workers need, and cost a few tensor objects per tensor."""
    classes = block.classes
    if views is not None and block.singles:
        norms = torch.stack(torch._foreach_norm([views[j] for j in block.singles], ord))
        if block.single_index is None:
            out.copy_(norms)
        else:
            out.index_copy_(0, block.single_index, norms)
        classes = block.grouped
    for j, k, n, at in classes:
        if n > ROW_ELEMENTS and ord == 2.0:
            out[j:j + k] = row_norms(flat[at:at + k * n].view(k, n))
        elif n:
            torch.linalg.vector_norm(flat[at:at + k * n].view(k, n), ord, dim=1, out=out[j:j + k])
        else:
            out[j:j + k].zero_()
    return out


class Workspace:
    """Reusable buffers for CPU steps over lists of tensors with ``shapes``: their ``Layout``; flat fp32
    buffers in layout order with views shaped like the tensors (``buffer``); per-tensor fp32 scalars in
    layout order with 0-dim views (``scalars``). Views are created once, not per step."""

    def __init__(self, shapes: Sequence[torch.Size]):
        self.shapes = [torch.Size(s) for s in shapes]
        self.layout = Layout([s.numel() for s in self.shapes])
        self._buffers: dict = {}
        self._scalars: dict = {}
        self._perm: torch.Tensor | None = None
        self._packed: Packed | None = None

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> Workspace:
        return cls([t.shape for t in tensors])

    def fits(self, tensors: Sequence[torch.Tensor]) -> bool:
        return [t.shape for t in tensors] == self.shapes

    def views_in_order(self, name: str) -> list[torch.Tensor]:
        """The views of ``buffer(name)`` in the tensors' order (not the layout's)."""
        key = ("in_order", name)
        if key not in self._buffers:
            views = self.buffer(name)[1]
            out: list = [None] * len(views)
            for at, i in enumerate(self.layout.perm):
                out[i] = views[at]
            self._buffers[key] = out
        return self._buffers[key]

    def has_shapes(self, shapes: Sequence[torch.Size]) -> bool:
        """``fits`` for tensors whose shapes the caller has at hand."""
        return list(shapes) == self.shapes

    def buffer(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A flat fp32 buffer of all the elements and its views, in layout order."""
        if name not in self._buffers:
            self._buffers[name] = flat_views([self.shapes[i] for i in self.layout.perm])
        return self._buffers[name]

    def packed(self) -> Packed:
        """The ``_cpu_packed.Packed`` layout of the same shapes (built on first use)."""
        if self._packed is None:
            from apex.ops._cpu_packed import Packed

            self._packed = Packed(self.shapes)
        return self._packed

    def perm_index(self) -> torch.Tensor:
        """``layout.perm`` as an int64 tensor (to gather per-tensor values in layout order)."""
        if self._perm is None:
            self._perm = torch.tensor(self.layout.perm, dtype=torch.int64)
        return self._perm

    def scalars(self, name: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One fp32 number per tensor, in layout order, and its 0-dim views."""
        if name not in self._scalars:
            self._scalars[name] = scalar_views(len(self.shapes))
        return self._scalars[name]


def flat_views(shapes: Sequence[torch.Size], fill: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A flat fp32 buffer for tensors of ``shapes`` (uninitialised, or ``fill``) and its views shaped like
    them, one after another."""
    numel = sum(torch.Size(s).numel() for s in shapes)
    flat = torch.empty(numel, dtype=torch.float32) if fill is None else torch.full((numel,), fill)
    views, at = [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        views.append(flat[at:at + n].view(shape))
        at += n
    return flat, views


def scalar_views(n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``n`` fp32 numbers and their 0-dim views (``torch._foreach_*`` ops take them as a list)."""
    vec = torch.empty(n, dtype=torch.float32)
    return vec, list(vec.unbind())


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


def run(fn: Callable, parts: list[list[int]], *lists: Sequence, threads: bool = True,
        per_part: Sequence | None = None) -> list:
    """``fn(*[[lst[i] for i in part] for lst in lists])`` for each part; the results, in part order.
    With ``per_part``, ``fn(per_part[k], ...)`` for part ``k``.

    With workers, the parts holding one tensor of at least ``BLOCK_ELEMENTS`` elements run first on the
    calling thread, then the others concurrently on the workers (part ``k`` of them on worker
    ``k mod n``, so the assignment is the same every call). ``threads=False``: all on the calling thread
    (for passes that only stream memory, where a second core adds no bandwidth)."""
    def pick(k):
        part = parts[k]
        picked = tuple([lst[i] for i in part] for lst in lists)
        return picked if per_part is None else (per_part[k], *picked)

    n = workers() if threads and len(parts) > 1 else 0
    if n == 0 or getattr(_LOCAL, "worker", False):
        return [fn(*pick(k)) for k in range(len(parts))]
    results: list = [None] * len(parts)
    small = []
    for k, part in enumerate(parts):
        if len(part) == 1 and lists[0][part[0]].numel() >= BLOCK_ELEMENTS:
            results[k] = fn(*pick(k))
        else:
            small.append(k)
    if not small:
        return results
    n = min(n, len(small))
    pool = _POOL.get(n)
    shares = [small[i::n] for i in range(n)]
    modes = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    futures = [pool.submit(i, _run_share, (fn, [pick(k) for k in share], modes))
               for i, share in enumerate(shares)]
    errors = [f.exception() for f in futures]  # waits for every worker, even when one fails
    for e in errors:
        if e is not None:
            raise e
    for share, f in zip(shares, futures):
        for k, r in zip(share, f.result()):
            results[k] = r
    return results


def _run_share(fn: Callable, args_list: list, modes: tuple[bool, bool]) -> list:
    grad_enabled, inference = modes
    # Grad mode and inference mode are per thread: take the caller's.
    with torch.inference_mode(inference), torch.set_grad_enabled(grad_enabled):
        return [fn(*args) for args in args_list]


class _Workers:
    """Threads with a queue each, so that task ``i`` of a call always runs on worker ``i``."""

    def __init__(self, n: int):
        self.pid = os.getpid()
        self.queues: list[queue.SimpleQueue] = []
        self.grow(n)

    def grow(self, n: int) -> None:
        """Start workers until there are ``n`` (the existing ones keep their queues and numbers)."""
        new = [queue.SimpleQueue() for _ in range(n - len(self.queues))]
        if not new:
            return
        ready = threading.Barrier(len(new) + 1)
        for q in new:
            threading.Thread(target=self._serve, args=(q, ready), daemon=True, name="apex-cpu-worker").start()
        ready.wait()
        self.queues = self.queues + new  # a new list: a caller iterating the old one is unaffected
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
    """The process's workers: created on first use, grown on demand (never replaced, so no thread is left
    idle), re-created after a fork (the child inherits no threads)."""

    def __init__(self):
        self._workers: _Workers | None = None
        self._lock = threading.Lock()

    def get(self, n: int) -> _Workers:
        with self._lock:
            w = self._workers
            if w is None or w.pid != os.getpid():
                w = self._workers = _Workers(n)
            else:
                w.grow(n)
            return w


_POOL = _Pool()
