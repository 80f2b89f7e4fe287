"""``multi_tensor_axpby(chunk_size, noop_flag, [xs, ys, outs], a, b, arg_to_check)``:
``out[i] = a * x[i] + b * y[i]`` computed in fp32 and rounded once to the output dtype.

``arg_to_check`` picks which inputs are checked for inf/NaN (setting ``noop_flag`` to 1): ``-1`` both,
``0`` only ``x``, ``1`` only ``y``. The outputs are written either way.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import check_noop_flag, check_tensor_lists, first_device, mark_found_inf


def multi_tensor_axpby(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, a: float, b: float,
                       arg_to_check: int) -> None:
    """``amp_C.multi_tensor_axpby``: lists ``[x, y, out]``, ``out = a*x + b*y`` in fp32;
    ``arg_to_check`` -1 checks both inputs for inf/NaN, 0 only ``x``, 1 only ``y`` (sets ``noop_flag``).
    """
    from apex._kernels._lists import checked

    tensor_lists = checked("axpby", tensor_lists, lambda: check_tensor_lists(tensor_lists, 3))
    device = first_device(tensor_lists)
    check_noop_flag(noop_flag, device)
    if arg_to_check not in (-1, 0, 1):
        raise ValueError(f"arg_to_check must be -1 (both), 0 (x) or 1 (y), got {arg_to_check!r}")
    if device is None or not tensor_lists[0]:
        return
    if _backend.select(tensor_lists[0]) == "triton":
        from apex._kernels import multi_tensor_axpby as kernels

        xs, ys, outs = (lst if isinstance(lst, (list, tuple)) else list(lst) for lst in tensor_lists)
        kernels.axpby(noop_flag, xs, ys, outs, float(a), float(b), arg_to_check)
        return
    with torch.no_grad():  # the foreach ops write tensors that may require grad
        _axpby_torch(noop_flag, *(list(lst) for lst in tensor_lists), a, b, arg_to_check)


def _axpby_torch(noop_flag, xs, ys, outs, a, b, arg_to_check) -> None:
    checked = (xs if arg_to_check in (-1, 0) else []) + (ys if arg_to_check in (-1, 1) else [])
    if checked:
        # Any non-finite x or y gives a non-finite norm, no host sync. A float64 L2 norm is non-finite exactly
        # then (squares of fp32/fp16/bf16 values cannot overflow float64) and runs 3x faster than PyTorch's
        # CPU inf-norm.
        norms = torch._foreach_norm(checked, 2, dtype=torch.float64)
        mark_found_inf(noop_flag, ~torch.isfinite(torch.stack(norms)).all())
    res = torch._foreach_mul([x.float() for x in xs], float(a))
    torch._foreach_add_(res, ys, alpha=float(b))  # in place; a 16-bit y is promoted, b*y computed in fp32
    torch._foreach_copy_(outs, res)
