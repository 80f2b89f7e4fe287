"""Count what Triton kernels do under the interpreter, and what eager PyTorch does for the same work.

:class:`TritonTrace` wraps the interpreter's memory operations and its grid executor while active:

* ``launches`` and ``kernels`` (launches per kernel name);
* ``bytes_requested``: bytes of every unmasked lane of every load and store;
* ``bytes_unique``: DRAM traffic with a perfect cache inside each launch and none between launches: per
  launch, the distinct addresses loaded plus the distinct addresses stored, times their element size, summed
  over launches. An in-place update that reads and writes ``p`` counts ``p`` twice (read and write), a value
  read twice by one launch once, and a value read by two launches twice.
* with ``bounds=True`` every unmasked access must fall inside the storage of a tensor passed to the
  launch or registered with :meth:`TritonTrace.watch`; anything else raises ``IndexError`` (an
  out-of-bounds store would otherwise corrupt the process).

:func:`count_eager` runs a function under a ``TorchDispatchMode`` and counts ATen ops (views, allocations
and host syncs excluded) and the bytes of their tensor inputs and outputs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


class TritonTrace:
    def __init__(self, bounds: bool = True, count: bool = True):
        self.bounds = bounds
        self.count = count
        self.launches = 0
        self.kernels: Counter = Counter()
        self.bytes_requested = 0
        # (kind, element size) -> address arrays of the launch in progress
        self._addresses: dict[tuple[str, int], list[np.ndarray]] = {}
        self._bytes_unique = 0
        self._watched: list[tuple[int, int]] = []
        self._launch_ranges: list[tuple[int, int]] = []
        self._saved: dict = {}
        self._sorted: tuple | None = None

    # -- public -------------------------------------------------------------------------------------
    def watch(self, *tensors) -> TritonTrace:
        """Allow accesses to these tensors (and nested lists of tensors) in every launch."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._watched.append(_storage_range(t))
                self._sorted = None
            elif isinstance(t, Iterable) and not isinstance(t, (str, bytes)):
                self.watch(*t)
        return self

    @property
    def bytes_unique(self) -> int:
        return self._bytes_unique + self._flush(keep=True)

    def _flush(self, keep: bool = False) -> int:
        """Distinct loaded plus distinct stored bytes of the launch in progress."""
        total = sum(nbytes * int(np.unique(np.concatenate(arrs)).size)
                    for (_, nbytes), arrs in self._addresses.items())
        if not keep:
            self._addresses = {}
        return total

    # -- machinery ------------------------------------------------------------------------------------
    def _ranges(self) -> tuple[np.ndarray, np.ndarray]:
        if self._sorted is None:
            spans = sorted(self._watched + self._launch_ranges)
            merged: list[list[int]] = []
            for lo, hi in spans:
                if merged and lo <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            arr = np.array(merged, dtype=np.uint64).reshape(-1, 2)
            self._sorted = (arr[:, 0].copy(), arr[:, 1].copy())
        return self._sorted

    def _check(self, addr: np.ndarray, nbytes: int, what: str) -> None:
        if addr.size == 0:
            return
        lo, hi = self._ranges()
        idx = np.searchsorted(lo, addr, side="right").astype(np.int64) - 1
        ok = idx >= 0
        ok[ok] = addr[ok] + np.uint64(nbytes) <= hi[idx[ok]]
        if not ok.all():
            bad = int(addr[~ok][0])
            raise IndexError(f"out-of-bounds {what} at address {bad:#x} ({int((~ok).sum())} lanes) "
                             "outside every tensor of this launch")

    def _record(self, ptrs, mask, what: str, kind: str = "load") -> None:
        addr = np.asarray(ptrs.data).astype(np.uint64).reshape(-1)
        if mask is not None:
            addr = addr[np.asarray(mask.data).astype(bool).reshape(-1)]
        nbytes = ptrs.get_element_ty().primitive_bitwidth // 8
        if self.bounds:
            self._check(addr, nbytes, what)
        if self.count:
            self.bytes_requested += int(addr.size) * nbytes
            self._addresses.setdefault((kind, nbytes), []).append(addr)

    def __enter__(self) -> TritonTrace:
        from triton.runtime import interpreter as itp

        builder, executor = itp.InterpreterBuilder, itp.GridExecutor
        self._saved = {
            "load": builder.create_masked_load,
            "store": builder.create_masked_store,
            "rmw": builder.create_atomic_rmw,
            "cas": builder.create_atomic_cas,
            "call": executor.__call__,
        }
        saved, trace = self._saved, self

        # The builder's leading arguments are read; the rest pass through as given (their number differs
        # between Triton releases: 3.6's masked load takes one more than 3.9's).
        def load(b, ptrs, mask, *rest):
            trace._record(ptrs, mask, "load")
            return saved["load"](b, ptrs, mask, *rest)

        def store(b, ptrs, value, mask, *rest):
            trace._record(ptrs, mask, "store", "store")
            return saved["store"](b, ptrs, value, mask, *rest)

        def rmw(b, op, ptr, val, mask, *rest):
            trace._record(ptr, mask, "atomic", "load")
            trace._record(ptr, mask, "atomic", "store")
            return saved["rmw"](b, op, ptr, val, mask, *rest)

        def cas(b, ptr, *rest):
            trace._record(ptr, None, "atomic", "load")
            trace._record(ptr, None, "atomic", "store")
            return saved["cas"](b, ptr, *rest)

        def call(ex, *args, **kwargs):
            trace.launches += 1
            trace.kernels[getattr(ex.fn, "__name__", "kernel")] += 1
            ranges = [_storage_range(a) for a in list(args) + list(kwargs.values())
                      if isinstance(a, torch.Tensor)]
            previous = trace._launch_ranges
            trace._launch_ranges = previous + ranges
            trace._sorted = None
            try:
                return saved["call"](ex, *args, **kwargs)
            finally:
                trace._launch_ranges = previous
                trace._sorted = None
                trace._bytes_unique += trace._flush()

        builder.create_masked_load = load
        builder.create_masked_store = store
        builder.create_atomic_rmw = rmw
        builder.create_atomic_cas = cas
        executor.__call__ = call
        return self

    def __exit__(self, *exc) -> None:
        from triton.runtime import interpreter as itp

        itp.InterpreterBuilder.create_masked_load = self._saved["load"]
        itp.InterpreterBuilder.create_masked_store = self._saved["store"]
        itp.InterpreterBuilder.create_atomic_rmw = self._saved["rmw"]
        itp.InterpreterBuilder.create_atomic_cas = self._saved["cas"]
        itp.GridExecutor.__call__ = self._saved["call"]


_IGNORED_PREFIXES = ("empty", "zeros", "ones", "full", "scalar_tensor", "_local_scalar_dense", "lift_fresh",
                     "detach", "alias", "_to_copy_noop", "new_empty", "set_", "resize_", "record_stream")


class _EagerCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.launches = 0
        self.bytes = 0
        self.syncs = 0
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.syncs += 1
            return out
        is_view = any(a.alias_info is not None and not a.alias_info.is_write
                      for a in func._schema.returns)
        if is_view or name.startswith(_IGNORED_PREFIXES):
            return out
        self.launches += 1
        self.ops[name] += 1
        seen: set = set()

        def add(x):
            if isinstance(x, torch.Tensor):
                self.bytes += x.numel() * x.element_size()
            elif isinstance(x, (list, tuple)):
                for v in x:
                    add(v)

        for a in list(args) + list(kwargs.values()):
            add(a)
        # Arguments the op writes in place (add_, _foreach_mul_, out=) are written once more; returns that
        # alias them are the same memory and are not counted again.
        bound = dict(zip((a.name for a in func._schema.arguments), args))
        bound.update(kwargs)
        for a in func._schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                add(bound.get(a.name))
        outs = out if isinstance(out, (list, tuple)) else [out]
        for o, r in zip(outs, list(func._schema.returns) + [None] * len(outs)):
            if r is not None and r.alias_info is not None:
                continue
            if isinstance(o, torch.Tensor) and id(o) not in seen:
                seen.add(id(o))
                add(o)
            elif isinstance(o, (list, tuple)):
                add(o)
        return out


def count_eager(fn: Callable[[], object]) -> dict:
    """Run ``fn`` once and return ``{"launches", "bytes", "syncs", "ops"}`` of the ATen ops it issued."""
    with _EagerCounter() as c:
        fn()
    return {"launches": c.launches, "bytes": c.bytes, "syncs": c.syncs, "ops": dict(c.ops)}


def speed_up_interpreter() -> None:
    """Patch ``triton.language`` once per launch instead of once per nested ``@jit`` call.

    The interpreter re-patches the language modules every time a kernel calls a ``@triton.jit`` helper;
    inside a launch the modules a helper uses are usually patched already, so the repeat is pure overhead
    (2-3x on kernels that call helpers). A helper whose module sees a language module not yet patched in
    this launch (``triton.language.core`` from ``triton.language.standard``, say) is patched as before.
    Idempotent; affects only interpreted runs.
    """
    import triton.language as tl
    from triton.runtime import interpreter as itp

    if getattr(itp.InterpretedFunction, "_apex_patched_once", False):
        return
    launch_state: list = []  # stack of (patched module ids, scopes) per active launch
    launch = itp.GridExecutor.__call__

    def langs_of(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def grid_call(self, *args, **kwargs):
        launch_state.append((set(langs_of(self.fn)), []))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _, scopes = launch_state.pop()
            for scope in reversed(scopes):
                if scope is not None:  # (Triton before 3.5 patches for good: nothing to restore)
                    scope.restore()

    def device_call(self, *args, **kwargs):
        if not launch_state:
            itp._patch_lang(self.fn)
        else:
            patched, scopes = launch_state[-1]
            needed = langs_of(self.fn)
            if not needed <= patched:
                scopes.append(itp._patch_lang(self.fn))
                patched |= needed
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise itp.InterpreterError(repr(e)) from e

    itp.GridExecutor.__call__ = grid_call
    itp.InterpretedFunction.__call__ = device_call
    itp.InterpretedFunction._apex_patched_once = True


def round_bf16_to_nearest_even() -> None:
    """Make the interpreter's fp32 → bf16 cast round to nearest even, as GPUs and PyTorch do.

    Triton 3.x's interpreter truncates instead, so about half the bf16 results of an interpreted kernel
    are one ulp off PyTorch's. Idempotent; affects only interpreted runs.
    """
    import triton.language as tl
    from triton.runtime import interpreter as itp

    if getattr(itp.InterpreterBuilder, "_apex_bf16_rne", False):
        return
    cast = itp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            data = np.ascontiguousarray(src.data, dtype=np.float32)
            bits = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return itp.TensorHandle(bits.reshape(data.shape), tl.bfloat16)
        return cast(self, src, dst_type)

    itp.InterpreterBuilder.cast_impl = cast_impl
    itp.InterpreterBuilder._apex_bf16_rne = True


def fp32_scalar_arguments() -> None:
    """Make interpreted kernels receive Python-float arguments as fp32 scalars, as compiled kernels do.

    Triton's interpreter hands a float argument to the kernel as a Python float, so ``1 - beta2`` computed in
    a kernel from ``beta2 = 0.999`` is exact there and 1.3e-5 off on a GPU, where the argument is fp32.
    Idempotent; :func:`wide_scalar_arguments` turns it off for a block (to compare the two).
    """
    import triton.language as tl
    from triton.runtime import interpreter as itp

    if getattr(itp._implicit_cvt, "_apex_fp32", False):
        return
    convert = itp._implicit_cvt

    def implicit_cvt(arg):
        if type(arg) is float and implicit_cvt.enabled:
            return tl.tensor(itp.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return convert(arg)

    implicit_cvt._apex_fp32 = True
    implicit_cvt.enabled = True
    itp._implicit_cvt = implicit_cvt


class wide_scalar_arguments:
    """``with wide_scalar_arguments():`` interpreted kernels get Python floats again (the bare interpreter's
    float64 arithmetic), where :func:`fp32_scalar_arguments` is on."""

    def __enter__(self) -> wide_scalar_arguments:
        from triton.runtime import interpreter as itp

        self._cvt = itp._implicit_cvt if getattr(itp._implicit_cvt, "_apex_fp32", False) else None
        if self._cvt is not None:
            self._was, self._cvt.enabled = self._cvt.enabled, False
        return self

    def __exit__(self, *exc) -> None:
        if self._cvt is not None:
            self._cvt.enabled = self._was


def prepare_interpreter() -> None:
    """Everything tests and benchmarks want from the interpreter: speed, GPU-like bf16 rounding, and fp32
    scalar arguments as a GPU launch passes them."""
    speed_up_interpreter()
    round_bf16_to_nearest_even()
    fp32_scalar_arguments()
