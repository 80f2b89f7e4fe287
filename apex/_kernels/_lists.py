"""Host side of the multi-tensor engine: lists of tensors with their metadata read once (torch only).

A multi-tensor launch needs, of each tensor, its address, its number of elements, its dtype and its device.
Reading them costs ~70 ns per attribute per tensor in Python, which for 10,000 parameters is more than the
GPU's own time for a step. So a list is read once into a :class:`Column` (a tuple of the tensors plus those
facts as tuples), and the device tables built from Columns are cached on the addresses
(``apex._kernels.multi_tensor``). Apex's optimizers keep the Columns of their parameters and states from step
to step and only make a new one for the gradients (whose addresses they have read anyway).

:func:`checked` is the other half: a call with lists whose metadata is exactly that of an earlier call that
passed the checks needs no new checks (the checks read nothing else), so ``amp_C`` ops called every step
with the same tensors pay one read of their addresses and one C-level guard call per list, not a full
validation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from operator import attrgetter

import torch

_ptr = torch.Tensor.data_ptr
_numel = torch.Tensor.numel
_contiguous = torch.Tensor.is_contiguous
_dtype = attrgetter("dtype")
_device = attrgetter("device")
_shape = attrgetter("shape")


class Column(tuple):
    """The tensors of one list of a multi-tensor call, with ``ptrs``, ``numels`` (tuples, one entry per
    tensor), ``dtype`` / ``device`` (the one dtype / device of the list, or None when mixed; then ``dtypes`` /
    ``devices`` hold one per tensor) and ``key`` (a hash of addresses and dtypes).

    Immutable: the facts are those of the moment it was made. Whoever hands the same Column to the engine
    again promises that its tensors' storage has not moved since (apex's optimizers check their parameters'
    addresses every step and make new Columns when one moved)."""

    ptrs: tuple
    numels: tuple
    dtype: torch.dtype | None
    device: torch.device | None
    dtypes: tuple
    devices: tuple
    key: int


def column(tensors: Sequence[torch.Tensor], *, ptrs: Sequence[int] | None = None,
           numels: tuple | None = None, dtype: torch.dtype | None = None,
           device: torch.device | None = None, dtypes: tuple | None = None,
           devices: tuple | None = None) -> Column:
    """A :class:`Column` of ``tensors``. Facts the caller already holds (``ptrs``, ``numels``, the one
    ``dtype`` and ``device`` of every tensor, or their ``dtypes`` / ``devices`` one per tensor) are taken as
    given; the others are read here."""
    col = Column(tensors)
    col.ptrs = tuple(map(_ptr, col)) if ptrs is None else tuple(ptrs)
    col.numels = tuple(map(_numel, col)) if numels is None else numels
    if dtype is None:
        dtypes = tuple(map(_dtype, col)) if dtypes is None else dtypes
        dtype = dtypes[0] if dtypes and dtypes.count(dtypes[0]) == len(dtypes) else None
        col.dtypes = dtypes
    else:
        col.dtypes = (dtype,) * len(col)
    if device is None:
        devices = tuple(map(_device, col)) if devices is None else devices
        device = devices[0] if devices and devices.count(devices[0]) == len(devices) else None
        col.devices = devices
    else:
        col.devices = (device,) * len(col)
    col.dtype, col.device = dtype, device
    col.key = hash((dtype, col.ptrs))
    return col


def columns(tensor_lists: Sequence[Sequence[torch.Tensor]]) -> list[Column]:
    """Each list as a Column (a list given twice is read once)."""
    out: list[Column] = []
    for lst in tensor_lists:
        if type(lst) is not Column:
            same = next((c for c, orig in zip(out, tensor_lists) if orig is lst), None)
            lst = same if same is not None else column(lst)
        out.append(lst)
    return out


class _Checked:
    """The signatures of recent calls that passed an op's checks, per (op, number of lists, lengths), with
    what the call read besides (each list's sizes, dtypes and devices) and how to recognise its tensors'
    metadata again (one guard per list, or the full signature where PyTorch has no guards)."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self.entries: OrderedDict = OrderedDict()

    def get(self, key):
        """``(sig, facts, guards, full)`` of the last call of ``key`` that passed, or None."""
        old = self.entries.get(key)
        if old is not None:
            self.entries.move_to_end(key)
        return old

    def put(self, key, entry: tuple) -> None:
        self.entries[key] = entry
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


_checked = _Checked()


def _signature(lst, shapes: bool) -> tuple:
    """What an op's list checks read of a list that can change at a given address: the size (or the shape,
    where the op compares shapes), the dtype and the layout of each tensor (shapes and strides only where one
    is not contiguous). Four C-level passes; used where :func:`_guards` has no guard."""
    contiguous = tuple(map(_contiguous, lst))
    sig = (tuple(map(_shape if shapes else _numel, lst)), tuple(map(_dtype, lst)), contiguous)
    if not all(contiguous):
        sig += (tuple(t.shape for t in lst), tuple(t.stride() for t in lst))
    return sig


def _guards(lists: list) -> list | None:
    """Per list (None for a list given again), a C-level check that tensors have exactly the metadata of its
    tensors now (TorchDynamo's ``TensorGuards``: type, dispatch keys, dtype, device, sizes, strides,
    requires_grad): one call instead of the four passes of :func:`_signature`. None where PyTorch has no
    guards, or where a list holds one tensor twice (which a guard never passes)."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        out = []
        for lst in lists:
            if isinstance(lst, int):
                out.append(None)
                continue
            # (both keywords always: the constructor reads them from the keyword dict, which must exist)
            g = TensorGuards(*lst, dynamic_dims_sizes=None, dynamic_dims_strides=None)
            if not g.check(*lst):
                return None
            out.append(g)
        return out
    except Exception:  # an older or a stripped build: the signatures do the work
        return None


def _facts(lst, shapes: bool) -> tuple:
    """``(numels, dtypes, device, devices)`` of a list: its sizes and dtypes, its one device (None when mixed)
    and, when mixed, the device of each tensor."""
    devices = tuple(map(_device, lst))
    device = devices[0] if devices and devices.count(devices[0]) == len(devices) else None
    return tuple(map(_numel, lst)), tuple(map(_dtype, lst)), device, devices if device is None else None


def checked(op, tensor_lists, check: Callable[[], object], *extra, shapes: bool = False) -> list:
    """Run ``check()`` (an op's argument checks, which raise on bad input) unless a call of ``op`` with lists
    of exactly these tensors' addresses and metadata (and the same ``extra`` facts) passed it before: the
    addresses are compared as a tuple per list, the rest by one guard call per list. ``shapes``: the checks
    compare shapes, not only sizes (a guard compares shapes).

    Returns the lists to work on: Columns made from what was read (so the engine reads nothing again), or
    ``tensor_lists`` itself when they are Columns already (lists apex made and checked itself)."""
    if not isinstance(tensor_lists, (list, tuple)) or not all(isinstance(lst, (list, tuple))
                                                              for lst in tensor_lists):
        check()  # (raises the TypeError)
        return tensor_lists
    if tensor_lists and all(type(lst) is Column for lst in tensor_lists):
        return list(tensor_lists)
    try:
        seen_lists: list = []
        sigs: list = []  # per list: the index of the same list object given earlier, or its addresses
        for lst in tensor_lists:
            j = next((i for i, other in enumerate(seen_lists) if other is lst), None)
            sigs.append(j if j is not None else tuple(map(_ptr, lst)))
            seen_lists.append(lst)
        sig = tuple(sigs) + extra
        key = (op, len(tensor_lists), tuple(len(lst) for lst in tensor_lists))
        entry = _checked.get(key)
        if entry is not None and entry[0] == sig:
            guards, full = entry[2], entry[3]
            if guards is not None:
                same = all(g is None or g.check(*lst) for g, lst in zip(guards, tensor_lists))
            else:
                same = full == tuple(s if isinstance(s, int) else _signature(lst, shapes)
                                     for lst, s in zip(tensor_lists, sigs))
            if not same:
                entry = None
        else:
            entry = None
    except (TypeError, AttributeError, RuntimeError, NotImplementedError):
        check()  # not tensors, or sparse ones: the checks say what is wrong
        return list(tensor_lists)
    if entry is None:
        check()
        facts = tuple(None if isinstance(s, int) else _facts(lst, shapes) for lst, s in zip(tensor_lists, sigs))
        guards = _guards([s if isinstance(s, int) else lst for lst, s in zip(tensor_lists, sigs)])
        full = None if guards is not None else tuple(s if isinstance(s, int) else _signature(lst, shapes)
                                                     for lst, s in zip(tensor_lists, sigs))
        entry = (sig, facts, guards, full)
        _checked.put(key, entry)
    out: list = []
    for lst, s, f in zip(tensor_lists, sigs, entry[1]):
        if isinstance(s, int):  # the same list object as an earlier one
            out.append(out[s])
            continue
        numels, dtypes, device, devices = f
        out.append(column(lst, ptrs=s, numels=numels, dtypes=dtypes, device=device, devices=devices))
    return out
