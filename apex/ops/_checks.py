"""Argument checks shared by the operations. Errors name the argument and what was expected."""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter, eq

import torch

from apex._errors import RuntimeTypeError, RuntimeValueError

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_shape = attrgetter("shape")


# Apex's amp_C checked what check_tensor_lists checks (multi_tensor_apply's TORCH_CHECKs: the number of lists,
# their lengths, each tensor's device, layout and size; a dispatch on the dtype) and the noop flag's dtype and
# device: those errors are also its RuntimeError. A non-tensor is pybind's TypeError there, a TypeError here.
def check_noop_flag(noop_flag: object, device: torch.device | None = None) -> torch.Tensor:
    if not isinstance(noop_flag, torch.Tensor):
        raise TypeError(f"noop_flag must be a torch.Tensor, got {type(noop_flag).__name__}")
    if noop_flag.dtype != torch.int32 or noop_flag.numel() != 1:
        raise RuntimeValueError("noop_flag must be a one-element torch.int32 tensor, got "
                                f"{noop_flag.dtype} with {noop_flag.numel()} elements")
    if device is not None and noop_flag.device != device:
        raise RuntimeValueError(f"noop_flag is on {noop_flag.device} but the tensors are on {device}")
    return noop_flag


def first_device(tensor_lists) -> torch.device | None:
    """The device of ``tensor_lists[0][0]`` (None when there is none): for callers that skip the checks."""
    return tensor_lists[0][0].device if tensor_lists and tensor_lists[0] else None


def in_param_shapes(grads, params) -> list:
    """``grads`` as a list, each in its parameter's shape. An optimizer's step plan compares a gradient's number
    of elements with its parameter's, not its shape (as Apex's engine does), so a gradient given that number
    in another shape behind the setter's back (``grad.data = ...``, ``grad.set_``) reaches the PyTorch paths,
    whose elementwise ops need equal shapes: it is read in flat order there too, as the kernels read it."""
    gs = list(grads)
    if all(map(eq, map(_shape, gs), map(_shape, params))):
        return gs
    return [g if g.shape == p.shape else g.reshape(p.shape) for g, p in zip(gs, params)]


def check_tensor_lists(
    tensor_lists: object,
    n_lists: int | Sequence[int] | None = None,
    *,
    name: str = "tensor_lists",
    dtypes: Sequence[torch.dtype] = FLOAT_DTYPES,
    list_dtypes: dict[int, Sequence[torch.dtype]] | None = None,
    same_shape: bool = False,
) -> torch.device | None:
    """Validate Apex's ``tensor_lists`` argument and return the common device (None if empty).

    ``n_lists``: the accepted number(s) of lists. Every list must have the same length; tensors at the
    same index must have the same number of elements (and shape with ``same_shape``); every tensor must
    be of a dtype in ``dtypes`` (or ``list_dtypes[i]`` for list ``i``) and on one device. As in Apex, a
    tensor may be contiguous or channels_last (``is_contiguous(memory_format=...)``): the kernels pair the
    elements of the tensors at one index by memory offset, so a non-contiguous one must have the shape
    and strides of ``tensor_lists[0][i]``.
    """
    if not isinstance(tensor_lists, (list, tuple)) or not all(isinstance(lst, (list, tuple))
                                                              for lst in tensor_lists):
        raise TypeError(f"{name} must be a list of lists of tensors")
    if n_lists is not None:
        allowed = (n_lists,) if isinstance(n_lists, int) else tuple(n_lists)
        if len(tensor_lists) not in allowed:
            raise RuntimeValueError(f"{name} must hold {' or '.join(map(str, allowed))} lists, got "
                                    f"{len(tensor_lists)}")
    if not tensor_lists:
        return None
    lengths = [len(lst) for lst in tensor_lists]
    if len(set(lengths)) != 1:
        raise RuntimeValueError(f"{name}: every list must have the same length, got lengths {lengths}")
    device = tensor_lists[0][0].device if tensor_lists[0] else None
    ref = tensor_lists[0]
    for li, lst in enumerate(tensor_lists):
        allowed_dtypes = (list_dtypes or {}).get(li, dtypes)
        # The common case (every tensor fine) stays cheap: a per-tensor error message is built only
        # when a check fails, by _diagnose.
        for ti, t in enumerate(lst):
            if not (isinstance(t, torch.Tensor) and t.dtype in allowed_dtypes and t.layout == torch.strided
                    and t.device == device
                    and (t.shape == ref[ti].shape if same_shape else t.numel() == ref[ti].numel())
                    and (t.is_contiguous() and (li == 0 or ref[ti].is_contiguous()) or _layout_ok(t, ref[ti], li))):
                _diagnose(name, li, ti, t, allowed_dtypes, device, ref[ti], same_shape)
    return device


def _layout_ok(t: torch.Tensor, ref: torch.Tensor, li: int) -> bool:
    """The slow part of the layout check: a list-0 tensor may be channels_last (Apex's rule); a tensor of
    another list must then have its shape and strides."""
    if li == 0:
        return (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
                or t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))
    return t.shape == ref.shape and t.stride() == ref.stride()


def _diagnose(name, li, ti, t, allowed_dtypes, device, ref, same_shape) -> None:
    where = f"{name}[{li}][{ti}]"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in allowed_dtypes:
        raise RuntimeTypeError(f"{where} has dtype {t.dtype}; expected one of "
                               f"{', '.join(str(d) for d in allowed_dtypes)}")
    if t.layout != torch.strided:
        raise RuntimeValueError(f"{where} must be dense, got a {t.layout} tensor")
    if t.device != device:
        raise RuntimeValueError(f"{where} is on {t.device} but {name}[0][0] is on {device}; "
                                "all tensors must be on one device")
    if (t.shape == ref.shape if same_shape else t.numel() == ref.numel()):
        if li == 0:
            raise RuntimeValueError(f"{where} must be contiguous or channels_last (call .contiguous() first)")
        raise RuntimeValueError(f"{where} must have the memory layout of {name}[0][{ti}]: strides "
                                f"{tuple(t.stride())} vs {tuple(ref.stride())} (call .contiguous() on both)")
    raise RuntimeValueError(f"{where} has shape {tuple(t.shape)} but {name}[0][{ti}] has shape "
                            f"{tuple(ref.shape)}")


def as_scalar_tensor(value, device: torch.device, name: str, dtype=torch.float32) -> torch.Tensor:
    """A one-element tensor on ``device`` from a Python number or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a number or a one-element tensor, got {value.numel()} elements")
        return value.reshape(1).to(device=device, dtype=dtype)
    if not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a one-element tensor, got {type(value).__name__}")
    return torch.full((1,), float(value), dtype=dtype, device=device)


def mark_found_inf(noop_flag: torch.Tensor, found_inf: torch.Tensor) -> None:
    """``noop_flag |= found_inf != 0`` on the device, without a host synchronisation."""
    torch.maximum(noop_flag, (found_inf != 0).to(torch.int32).reshape(1), out=noop_flag)


def member_set(*items: object) -> dict:
    """A constant set for the checks' membership tests (``x in s``): a dict's keys. A lookup costs what a
    frozenset's does (~45 ns; a tuple of four takes 80-120 ns), and torch.compile traces it on every
    supported torch (Dynamo before 2.11 cannot trace ``frozenset.__contains__`` or ``set.__contains__``)."""
    return dict.fromkeys(items)
