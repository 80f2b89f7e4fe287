"""``multi_tensor_scale``: ``out[i] = in[i] * scale`` for every tensor pair, flagging non-finite inputs.

Math in fp32 whatever the storage dtypes (fp32/fp16/bf16 in any combination), one rounding to the output
dtype. ``noop_flag`` is set to 1 when any *input* element is inf or NaN; the outputs are written anyway
(Apex propagates infs and NaNs so the caller can decide to skip the step).

``scale`` may be a Python number or a one-element tensor; a tensor (a clipping coefficient computed on the
GPU, say) is read on the device, without a host synchronisation.
"""

from __future__ import annotations

import torch

from apex import _backend
from apex.ops._checks import as_scalar_tensor, check_noop_flag, check_tensor_lists, first_device, mark_found_inf


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists,
                       scale: float | torch.Tensor) -> None:
    """``amp_C.multi_tensor_scale``: lists ``[in, out]``, ``out = in * scale`` computed in fp32 and rounded
    once to ``out``'s dtype; sets ``noop_flag`` (a one-element int32 tensor) when an input is inf/NaN.
    """
    from apex._kernels._lists import checked

    tensor_lists = checked("scale", tensor_lists, lambda: check_tensor_lists(tensor_lists, 2))
    device = first_device(tensor_lists)
    check_noop_flag(noop_flag, device)
    if device is None or not tensor_lists[0]:
        return
    ins, outs = tensor_lists
    if _backend.select(ins) == "triton":
        from apex._kernels import multi_tensor_scale as kernels

        # Lists as given (a tuple or a Column is read as it is); a Python scale is passed by value.
        kernels.scale(noop_flag, _seq(ins), _seq(outs),
                      as_scalar_tensor(scale, device, "scale") if isinstance(scale, torch.Tensor) else scale)
        return
    with torch.no_grad():  # the foreach ops write tensors that may require grad
        _scale_torch(noop_flag, list(ins), list(outs), as_scalar_tensor(scale, device, "scale"))


def _seq(lst):
    return lst if isinstance(lst, (list, tuple)) else list(lst)


def _scale_torch(noop_flag, ins, outs, scale: float | torch.Tensor) -> None:
    found_inf = torch.zeros(1, dtype=torch.float32, device=noop_flag.device)
    scale_t = as_scalar_tensor(scale, noop_flag.device, "scale")
    # Same dtype or an exact upcast: copy, then scale in place (PyTorch's op computes in fp32 and checks
    # the values before scaling). A downcast scales in fp32 first so there is only one rounding.
    direct = [i for i, (x, o) in enumerate(zip(ins, outs))
              if x.dtype == o.dtype or o.dtype == torch.float32]
    if direct:
        d_in, d_out = [ins[i] for i in direct], [outs[i] for i in direct]
        for x, o in zip(d_in, d_out):
            if o.data_ptr() != x.data_ptr():
                o.copy_(x)
        torch._amp_foreach_non_finite_check_and_unscale_(d_out, found_inf, scale_t)
    direct_set = set(direct)
    rest = [i for i in range(len(ins)) if i not in direct_set]
    if rest:
        tmp = [ins[i].to(torch.float32, copy=True) for i in rest]
        torch._amp_foreach_non_finite_check_and_unscale_(tmp, found_inf, scale_t)
        torch._foreach_copy_([outs[i] for i in rest], tmp)
    mark_found_inf(noop_flag, found_inf)
