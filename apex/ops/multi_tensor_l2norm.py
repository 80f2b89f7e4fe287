"""L2 norms of tensor lists, Apex's ``amp_C`` family:

* ``multi_tensor_l2norm(chunk_size, noop_flag, [xs], per_tensor=False)`` → ``(total, per_tensor_norms)``:
  ``total = sqrt(Σ_i ‖x_i‖²)`` as a one-element fp32 tensor, ``per_tensor_norms[i] = ‖x_i‖`` (an empty
  tensor unless ``per_tensor``).
* ``multi_tensor_l2norm_mp``: the same, but the whole call is a no-op returning zeros when ``noop_flag`` is
  already set (so a step that found inf/NaN does not read its gradients again).
* ``multi_tensor_l2norm_scale(chunk_size, noop_flag, [xs, outs], scale, per_tensor=False)``: also writes
  ``outs[i] = xs[i] * scale``; the norms are of the unscaled ``xs``.
* ``multi_tensor_unscale_l2norm(chunk_size, noop_flag, [xs], inv_scale, per_tensor=False)``: norms of
  ``xs * inv_scale`` (``inv_scale`` a one-element fp32 tensor), nothing written.
* ``multi_tensor_norm_out_cuda(chunk_size, noop_flag, [xs], out, alpha, beta, norm_type)``: blends each
  tensor's norm ``n_i`` into ``out[i]``: ``sqrt(alpha*out² + beta*n²)`` for ``norm_type=2``,
  ``alpha*out + beta*n`` for the max norm (``norm_type=0``). Returns nothing.

Accumulation is fp32 for every input dtype. ``noop_flag`` is set when a norm is not finite.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import check_noop_flag, check_tensor_lists, first_device, mark_found_inf
from apex.ops._cpu_norms import fp32_norms


def _empty_result(device, n: int, per_tensor: bool):
    return (torch.zeros(1, dtype=torch.float32, device=device),
            torch.zeros(n if per_tensor else 0, dtype=torch.float32, device=device))


def _torch_norms(xs, per_tensor: bool, ord: float = 2.0, inv_scale=None):
    sizes = list(map(torch.Tensor.numel, xs))
    nonempty = xs if 0 not in sizes else [x for x, n in zip(xs, sizes) if n > 0]
    if len(nonempty) == len(xs):
        per = fp32_norms(xs, ord, sizes)
    else:
        per = torch.zeros(len(xs), dtype=torch.float32, device=xs[0].device)
        if nonempty:
            idx = torch.tensor([i for i, x in enumerate(xs) if x.numel() > 0], device=xs[0].device)
            per[idx] = fp32_norms(nonempty, ord)
    if nonempty:
        if inv_scale is not None:
            # ‖s·x‖ = |s|·‖x‖ for both norms; the fp32 accumulation cannot overflow before the scaling.
            per = per * inv_scale.abs()
    total = (per.max() if ord == float("inf") else torch.linalg.vector_norm(per)).reshape(1)
    return total, per


def _dispatch(noop_flag, xs, per_tensor: bool, *, ord=2.0, outs=None, scale=1.0, inv_scale=None,
              skip_if_flagged=False, blend_into=None, alpha=1.0, beta=1.0):
    if _backend.select(xs) == "triton":
        from apex._kernels import multi_tensor_l2norm as kernels

        # (Lists as given: Columns from an optimizer stay Columns.)
        return kernels.norms(noop_flag, xs if isinstance(xs, (list, tuple)) else list(xs), per_tensor=per_tensor,
                             outputs=outs, out_scale=scale, inv_scale=inv_scale, max_norm=ord == float("inf"),
                             skip_if_flagged=skip_if_flagged, blend_into=blend_into, alpha=alpha, beta=beta)
    with torch.no_grad():  # norms of parameters that require grad must not record a graph
        return _dispatch_torch(noop_flag, xs, per_tensor, ord=ord, outs=outs, scale=scale, inv_scale=inv_scale,
                               skip_if_flagged=skip_if_flagged, blend_into=blend_into, alpha=alpha, beta=beta)


def _dispatch_torch(noop_flag, xs, per_tensor: bool, *, ord, outs, scale, inv_scale, skip_if_flagged, blend_into,
                    alpha, beta):
    if outs is not None:
        from apex.ops.multi_tensor_scale import _scale_torch

        scratch = torch.zeros_like(noop_flag)
        _scale_torch(scratch, list(xs), list(outs), scale)
    total, per = _torch_norms(list(xs), per_tensor, ord, inv_scale)
    if skip_if_flagged:
        keep = (noop_flag == 0).to(torch.float32)
        total, per = total * keep, per * keep
    mark_found_inf(noop_flag, ~torch.isfinite(total))
    if blend_into is not None:
        if ord == float("inf"):
            blend_into.mul_(alpha).add_(per, alpha=beta)
        else:
            blend_into.copy_(torch.sqrt(alpha * blend_into * blend_into + beta * per * per))
        return total, blend_into
    return total, (per if per_tensor else per[:0])


def _prologue(noop_flag, tensor_lists, n_lists, validate: bool = True):
    """``(device, lists)``: the lists checked (see ``_lists.checked``) unless the caller (an apex optimizer)
    has checked every tensor."""
    if not validate:
        return first_device(tensor_lists), tensor_lists
    from apex._kernels._lists import checked

    tensor_lists = checked(("l2norm", n_lists), tensor_lists, lambda: check_tensor_lists(tensor_lists, n_lists))
    device = first_device(tensor_lists)
    check_noop_flag(noop_flag, device)
    return device, tensor_lists


def multi_tensor_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                        per_tensor: bool | None = False, *,
                        validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``amp_C.multi_tensor_l2norm``: ``(total_norm, per_tensor_norms)`` of the tensors in
    ``tensor_lists[0]``, in fp32; per-tensor norms only with ``per_tensor=True`` (an empty tensor otherwise).
    Sets ``noop_flag`` on a non-finite value.
    """
    device, tensor_lists = _prologue(noop_flag, tensor_lists, 1, validate)
    if device is None or not tensor_lists[0]:
        return _empty_result(noop_flag.device, 0, bool(per_tensor))
    return _dispatch(noop_flag, tensor_lists[0], bool(per_tensor))


def multi_tensor_l2norm_mp(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                           per_tensor: bool | None = False, *,
                           validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`multi_tensor_l2norm`, but returns zeros without reading the tensors when ``noop_flag``
    is already set.
    """
    device, tensor_lists = _prologue(noop_flag, tensor_lists, 1, validate)
    if device is None or not tensor_lists[0]:
        return _empty_result(noop_flag.device, 0, bool(per_tensor))
    return _dispatch(noop_flag, tensor_lists[0], bool(per_tensor), skip_if_flagged=True)


def multi_tensor_l2norm_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, scale: float,
                              per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``amp_C.multi_tensor_l2norm_scale``: lists ``[in, out]``; the norms of ``in`` (as
    :func:`multi_tensor_l2norm`) and ``out = in * scale`` in one pass.
    """
    device, tensor_lists = _prologue(noop_flag, tensor_lists, 2)
    if device is None or not tensor_lists[0]:
        return _empty_result(noop_flag.device, 0, bool(per_tensor))
    return _dispatch(noop_flag, tensor_lists[0], bool(per_tensor), outs=tensor_lists[1], scale=float(scale))


def multi_tensor_unscale_l2norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                                inv_scale: torch.Tensor,
                                per_tensor: bool | None = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``amp_C.multi_tensor_unscale_l2norm``: the norms of ``in * inv_scale`` (a one-element tensor);
    nothing is written.
    """
    device, tensor_lists = _prologue(noop_flag, tensor_lists, 1)
    if not isinstance(inv_scale, torch.Tensor) or inv_scale.numel() != 1:
        raise TypeError("inv_scale must be a one-element tensor")
    if device is None or not tensor_lists[0]:
        return _empty_result(noop_flag.device, 0, bool(per_tensor))
    inv = inv_scale.to(device=device, dtype=torch.float32).reshape(1)
    return _dispatch(noop_flag, tensor_lists[0], bool(per_tensor), inv_scale=inv)


def multi_tensor_norm_out_cuda(chunk_size: int, noop_flag: torch.Tensor, tensor_lists, out: torch.Tensor,
                               alpha: float, beta: float, norm_type: int) -> None:
    """``amp_C.multi_tensor_norm_out_cuda``: blends each tensor's norm into ``out``
    (``out = alpha * out + beta * norm``; ``norm_type`` 2 = L2, 0 = max norm), as NovoGrad needs.
    """
    device, tensor_lists = _prologue(noop_flag, tensor_lists, 1)
    if norm_type not in (0, 2):
        raise ValueError(f"norm_type must be 0 (max norm) or 2 (L2 norm), got {norm_type!r}")
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32 or \
            out.numel() != len(tensor_lists[0]) or (device is not None and out.device != device):
        raise ValueError(f"out must be a float32 tensor of {len(tensor_lists[0])} elements on the tensors' device")
    if device is None or not tensor_lists[0]:
        return
    _dispatch(noop_flag, tensor_lists[0], True, ord=float("inf") if norm_type == 0 else 2.0,
              blend_into=out, alpha=float(alpha), beta=float(beta))
