"""``index_mul_2d(in1, in2, idx1) = in1[idx1] * in2`` for 2-D ``in1`` ``[R, F]``, ``in2`` ``[M, F]`` and
``idx1`` ``[M]`` (Apex's ``apex.contrib.index_mul_2d``, used by OpenFold), with first and second derivatives.

Gradients: ``d in2 = g * in1[idx1]``; ``d in1[r] = Σ_{i: idx1[i] = r} g[i] * in2[i]``, a segment sum over
repeated indices. That sum is deterministic on both paths: the Triton path sorts ``idx1`` (stable; once
while the same ``idx1`` is unchanged, :class:`IndexOrders`) and each program adds its rows' contributions
in that order (no atomics, unlike Apex's kernel); the PyTorch path uses ``index_add_``, sequential on CPU.
Double backward (forces of an energy, as in Apex's test) is supported by a second autograd function built
from the same two primitives.

An index outside ``in1``'s rows: the PyTorch path raises ``ValueError`` (one host read of idx1's range). The
Triton path reads nothing on the host (on a GPU a read is a synchronisation per call; Apex's kernel checks
nothing and reads out of bounds): that output row is NaN, the row adds nothing to ``in1``'s gradient and its
``in2`` gradient is zero.

Dtype policy: fp32/fp16/bf16 (and fp64 on PyTorch), ``in1`` and ``in2`` of one dtype; products in fp32 with
one rounding to that dtype; segment sums accumulate in fp32 (fp64 for fp64).
"""

from __future__ import annotations

import weakref

import torch

from apex._errors import AssertValueError, RuntimeTypeError, RuntimeValueError
from apex.ops._dispatch import lazy_module
from apex.ops._index_mul_direct import Lean
from apex.ops._norm import check_devices, select

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.index_mul_2d")


_INDEX_DTYPES = (torch.int64, torch.int32)


def _check(in1: object, in2: object, idx1: object, bounds: bool = True) -> None:
    """The arguments' types, ranks, shapes and devices; with ``bounds``, idx1's range too (one host read)."""
    # The usual call (three plain tensors of the right kinds on one device) passes in one test reading each fact
    # once (~1.5 µs less than the checks below); anything else takes those checks and their errors.
    if isinstance(in1, Tensor) and isinstance(in2, Tensor) and isinstance(idx1, Tensor):
        dt = in1.dtype
        if dt.is_floating_point and in2.dtype is dt and idx1.dtype in _INDEX_DTYPES and in1.dim() == 2 and \
                in2.dim() == 2 and idx1.dim() == 1:
            s2, dev = in2.shape, in1.device
            if in1.shape[1] == s2[1] and idx1.shape[0] == s2[0] and in2.device == dev == idx1.device:
                if bounds:
                    _check_bounds(in1, idx1)
                return
    _check_all(in1, in2, idx1)
    if bounds:
        _check_bounds(in1, idx1)


def _check_all(in1: object, in2: object, idx1: object) -> None:
    # Where Apex raised RuntimeError (dtypes, ranks) or asserted (idx1's length), the error is also that type.
    for name, t in (("in1", in1), ("in2", in2)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise RuntimeTypeError(f"{name} must be a floating-point torch.Tensor")
        if t.dim() != 2:
            raise RuntimeValueError(f"{name} must be a 2-D tensor, got shape {list(t.shape)}")
    if in2.dtype != in1.dtype:
        raise RuntimeTypeError(f"in1 and in2 must have the same dtype, got {in1.dtype} and {in2.dtype}")
    if in1.shape[1] != in2.shape[1]:
        raise ValueError(f"in1 and in2 must have the same number of columns, got {in1.shape[1]} and "
                         f"{in2.shape[1]}")
    if not isinstance(idx1, torch.Tensor) or idx1.dtype not in _INDEX_DTYPES:
        raise TypeError("idx1 must be an int64 or int32 tensor")
    if idx1.dim() != 1:
        raise RuntimeValueError(f"idx1 must be 1-D with in2's {in2.shape[0]} rows, got shape {list(idx1.shape)}")
    if idx1.shape[0] != in2.shape[0]:
        raise AssertValueError(f"idx1 must be 1-D with in2's {in2.shape[0]} rows, got shape {list(idx1.shape)}")
    dev = in1.device
    if in2.device != dev or idx1.device != dev:
        name, t = ("in2", in2) if in2.device != dev else ("idx1", idx1)
        raise ValueError(f"{name} is on {t.device} but in1 is on {dev}")


def _check_bounds(in1: Tensor, idx1: Tensor) -> None:
    """idx1's range, for the PyTorch path (the Triton kernels give an out-of-range index a defined result
    instead: no host read, which on a GPU is a synchronisation per call)."""
    if idx1.numel():
        # idx1 clamped to the rows and compared with itself: two operators and one host read (torch.equal) instead
        # of aminmax, a stack and a transfer; the extremes, for the message, only when something is out of range.
        rows = in1.shape[0]
        if not torch.equal(idx1.clamp(0, rows - 1), idx1):
            lo, hi = torch.stack(idx1.aminmax()).tolist()
            _check_range(lo, hi, rows)


def _check_range(lo: int, hi: int, rows: int) -> None:
    if lo < 0 or hi >= rows:
        raise ValueError(f"idx1 must index in1's rows [0, {rows}), got values in [{lo}, {hi}]")


def _triton(t: Tensor) -> bool:
    return t.dtype != torch.float64 and select(t) == "triton"


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _idx64(idx: Tensor) -> Tensor:
    """The kernels' index: int64, contiguous (no operator where it is already: ``.to`` costs ~1 µs)."""
    if idx.dtype != torch.int64:
        idx = idx.to(torch.int64)
    return idx if idx.is_contiguous() else idx.contiguous()


class IndexOrders:
    """The Triton path's stable sort of ``idx1`` (its int64 form, the sorted values, the permutation), kept
    while that tensor lives unchanged, for the last ``size`` index tensors: a model that applies
    ``index_mul_2d`` with one ``idx1`` in several layers, or one step after another, sorts it once. A sort
    is several operators (on a GPU a radix sort of several launches and a temporary buffer: tens of µs of
    host time), the largest cost of a call after its kernels.

    An entry is used only for the very tensor it was made from (a weak reference, so the entry goes when
    the tensor does), at the same version counter (any in-place change, ``copy_``, ``set_``, ``resize_``,
    also through a view, bumps it), the same data pointer and the same length and stride (an assignment to
    ``.data`` changes those, not the version). Inference tensors have no version counter: never kept."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: dict[int, tuple] = {}  # id(idx1) -> (weak ref, version, data_ptr, len, stride, order)

    def get(self, idx1: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(idx, ordered, perm)``: ``idx1`` as a contiguous int64 tensor, and its stable sort."""
        key = id(idx1)
        e = self._entries.get(key)
        # (len: its size, one slot call; stride(), no argument: stride(0) parses its int-or-name overloads)
        if e is not None and e[0]() is idx1 and e[1] == idx1._version and e[2] == idx1.data_ptr() and \
                e[3] == len(idx1) and e[4] == idx1.stride():
            idx, ordered, perm = e[5]
            return idx1 if idx is None else idx, ordered, perm
        idx = _idx64(idx1)
        ordered, perm = torch.sort(idx, stable=True)
        if idx1.is_inference():
            return idx, ordered, perm
        entries = self._entries
        if len(entries) >= self.size:
            del entries[next(iter(entries))]  # the oldest
        ref = weakref.ref(idx1, lambda r, key=key: entries.pop(key) if entries.get(key, (None,))[0] is r else None)
        # Not idx1 itself (a strong reference would keep it, and its entry, alive): None stands for it.
        entries[key] = (ref, idx1._version, idx1.data_ptr(), len(idx1), idx1.stride(),
                        (None if idx is idx1 else idx, ordered, perm))
        return idx, ordered, perm


_ORDERS = IndexOrders()


# ------------------------------------------------------------------------------- primitives (no autograd)
def gather_mul(a: Tensor, b: Tensor, idx: Tensor) -> Tensor:
    """``a[idx] * b`` in ``b``'s dtype."""
    if _triton(b):
        return _kernels().gather_mul(_rows(a), _rows(b), _idx64(idx), b.dtype)
    return torch.index_select(a, 0, idx).mul_(b)


def segment_mul_sum(g: Tensor, b: Tensor, idx: Tensor, rows: int) -> Tensor:
    """``out[r] = Σ_{i: idx[i] = r} g[i] * b[i]`` (``rows`` rows), accumulated in fp32, deterministic."""
    if _triton(b):
        return _kernels().segment_mul_sum(_rows(g), _rows(b), _idx64(idx), rows, b.dtype)
    ct = torch.float64 if b.dtype == torch.float64 else torch.float32
    out = torch.zeros(rows, b.shape[1], dtype=ct, device=b.device)
    return out.index_add_(0, idx, g.to(ct) * b.to(ct)).to(b.dtype)


def backward_pair(g: Tensor, in1: Tensor, in2: Tensor, idx: Tensor) -> tuple[Tensor, Tensor]:
    """``(segment_mul_sum(g, in2), in1[idx] * g)``: on the Triton path one pass over ``g`` and ``in2``."""
    if _triton(in2):
        return _kernels().segment_mul_sum(_rows(g), _rows(in2), _idx64(idx), in1.shape[0], in2.dtype, _rows(in1))
    return segment_mul_sum(g, in2, idx, in1.shape[0]), gather_mul(in1, g, idx)


# --------------------------------------------------------------------------------------------- autograd
class IndexMul2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, in1, in2, idx1, orders=None):
        # orders: an IndexOrders to take idx1's sort from (the eager entry's; not while tracing or under
        # torch.func transforms, where idx1 is not the caller's tensor)
        _check(in1, in2, idx1, bounds=False)
        if _triton(in2):
            # The backend chosen once (the backward launches the same path). The backward's segment sum needs
            # idx1 sorted (its deterministic order): sorted here, kept for the backward. No range check: the
            # kernels give an out-of-range index a NaN row and no gradient (no host read).
            if orders is not None:
                idx, ordered, perm = orders.get(idx1)
            else:
                idx = _idx64(idx1)
                ordered, perm = torch.sort(idx, stable=True)
            # The inputs themselves are saved (a double backward differentiates through them), not their
            # row-contiguous copies.
            ctx.save_for_backward(in1, in2, idx, ordered, perm)  # the sort saved: the Triton path's mark
            return _kernels().gather_mul(_rows(in1), _rows(in2), idx, in2.dtype)
        _check_bounds(in1, idx1)
        ctx.save_for_backward(in1, in2, idx1)
        return torch.index_select(in1, 0, idx1).mul_(in2)

    @staticmethod
    def backward(ctx, grad_out):
        in1, in2, idx1, *order = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: the gradients are themselves differentiable
            grad_in1, grad_in2 = IndexMul2dBackward.apply(in1, in2, idx1, grad_out)
        elif order:  # the Triton path
            # No create_graph: nothing will differentiate the gradients, so the second Function (the double
            # backward's graph node, ~15 µs) is not needed; its forward computes the same thing.
            grad_in1, grad_in2 = _kernels().segment_mul_sum(_rows(grad_out), _rows(in2), idx1, in1.shape[0],
                                                            in2.dtype, _rows(in1), order)
        else:
            grad_in1, grad_in2 = backward_pair(grad_out, in1, in2, idx1)
        return grad_in1, grad_in2, None, None


class IndexMul2dBackward(torch.autograd.Function):
    """``(d in1, d in2)`` from ``grad_out``, itself differentiable (for double backward)."""

    @staticmethod
    def forward(ctx, in1, in2, idx1, grad_out):
        ctx.save_for_backward(in1, in2, idx1, grad_out)
        return backward_pair(grad_out, in1, in2, idx1)

    @staticmethod
    def backward(ctx, gg1, gg2):
        in1, in2, idx1, g = ctx.saved_tensors
        gg1 = gg1 if gg1 is not None else torch.zeros_like(in1)
        gg2 = gg2 if gg2 is not None else torch.zeros_like(in2)
        d_in1, d_in2 = backward_pair(g, gg1, gg2, idx1)
        d_g = gather_mul(gg1, in2, idx1).add_(gather_mul(in1, gg2, idx1))
        return d_in1, d_in2, None, d_g


def _general_backward(grad_out: Tensor, in1: Tensor, in2: Tensor, idx: Tensor, order: tuple) -> tuple:
    """:meth:`IndexMul2d.backward` of the Triton path, for the planned path's Function (its saved inputs, int64
    index and sort)."""
    if torch.is_grad_enabled():  # create_graph: the gradients are themselves differentiable
        return IndexMul2dBackward.apply(in1, in2, idx, grad_out)
    return _kernels().segment_mul_sum(_rows(grad_out), _rows(in2), idx, in1.shape[0], in2.dtype, _rows(in1), order)


# The planned eager Triton path (apex.ops._index_mul_direct), which the entry tries first: a hit stands for the
# checks, which passed for the same facts.
_lean = Lean(_kernels, _check, _idx64, _general_backward).run


def index_mul_2d(in1: Tensor, in2: Tensor, idx1: Tensor) -> Tensor:
    """``in1[idx1] * in2``, differentiable twice in ``in1`` and ``in2``."""
    out = _lean(in1, in2, idx1, _ORDERS)
    if out is not None:
        return out
    # Outside torch.func transforms and tracing, the C++ Function.apply without its Python wrapper (which
    # unwraps torch.func's dead wrappers, ~4 µs).
    if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
        return IndexMul2d.apply(in1, in2, idx1)
    if not (torch.is_grad_enabled() and torch._C._any_requires_grad(in1, in2)):
        # Nothing to record: the product alone, without the Function's context and saved tensors.
        _check(in1, in2, idx1, bounds=False)
        if _triton(in2):
            return _kernels().gather_mul(_rows(in1), _rows(in2), _idx64(idx1), in2.dtype)
        _check_bounds(in1, idx1)
        return torch.index_select(in1, 0, idx1).mul_(in2)
    return _apply(in1, in2, idx1, _ORDERS)


_apply = super(torch.autograd.Function, IndexMul2d).apply


# -------------------------------------------------------------- Apex's ``fused_index_mul_2d`` entry points
def float_forward(out: Tensor, in1: Tensor, in2: Tensor, idx1: Tensor) -> None:
    """``fused_index_mul_2d.float_forward``: writes ``in1[idx1] * in2`` into ``out``."""
    _check(in1, in2, idx1)
    out.copy_(gather_mul(in1, in2, idx1))


def float_backward(grad_in1: Tensor, grad_in2: Tensor, grad_out: Tensor, in1: Tensor, in2: Tensor,
                   idx1: Tensor) -> None:
    """``fused_index_mul_2d.float_backward``: adds into ``grad_in1`` (zeroed by the caller, as in Apex) and
    writes ``grad_in2``."""
    _check(in1, in2, idx1)
    check_devices(in1, ("grad_out", grad_out), what="in1")
    d1, d2 = backward_pair(grad_out, in1, in2, idx1)
    grad_in1.add_(d1)
    grad_in2.copy_(d2)


def float_backward_backward(grad_grad_out: Tensor, grad_in1: Tensor, grad_in2: Tensor, grad_out: Tensor,
                            grad_grad_in1: Tensor, grad_grad_in2: Tensor, in1: Tensor, in2: Tensor,
                            idx1: Tensor) -> None:
    """``fused_index_mul_2d.float_backward_backward``: the double-backward products, into the first three."""
    _check(in1, in2, idx1)
    check_devices(in1, ("grad_out", grad_out), ("grad_grad_in1", grad_grad_in1), ("grad_grad_in2", grad_grad_in2),
                  what="in1")
    grad_grad_out.copy_(gather_mul(grad_grad_in1, in2, idx1).add_(gather_mul(in1, grad_grad_in2, idx1)))
    d1, d2 = backward_pair(grad_out, grad_grad_in1, grad_grad_in2, idx1)
    grad_in1.add_(d1)
    grad_in2.copy_(d2)


half_forward = float_forward
half_backward = float_backward
half_backward_backward = float_backward_backward
