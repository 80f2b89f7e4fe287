"""Apex's dynamic loss scaler (``apex.amp.scaler.LossScaler``), shared by ``amp`` and ``FP16_Optimizer``.

Dynamic mode: the scale starts at ``init_scale`` (2**16); a step whose gradients hold an inf or NaN is
skipped and the scale is halved (never below ``min_loss_scale`` when one is set); after ``scale_window``
(2000) consecutive clean steps the scale doubles (never above ``max_loss_scale``, 2**24). Static mode
keeps the scale fixed and never skips.

Unscaling is one ``multi_tensor_scale`` call per list (a Triton launch per dtype group on GPUs, PyTorch's
``_amp_foreach_non_finite_check_and_unscale_`` on CPUs). The overflow flag stays on the device until
:meth:`LossScaler.update_scale` reads it, so a step costs one host synchronisation whatever the number of
gradients. The attribute names (``_loss_scale``, ``_unskipped``, ``_has_overflow``, ``_overflow_buf``,
``_scale_seq_len``, ``_min_loss_scale``, ``_max_loss_scale``, ``dynamic``) are Apex's: client code reads
and patches them.
"""

from __future__ import annotations

import warnings
from functools import partial
from itertools import repeat
from operator import attrgetter, is_not

import torch

from apex import _backend
from apex.ops._checks import mark_found_inf
from apex.ops.multi_tensor_axpby import multi_tensor_axpby
from apex.ops.multi_tensor_scale import multi_tensor_scale

_CHUNK = 2048 * 32
_dtype = attrgetter("dtype")
_not_none = partial(is_not, None)


def _split_contiguous(*lists):
    """Indices of the positions where every list's tensor is contiguous, and of the others."""
    if all(all(map(torch.Tensor.is_contiguous, lst)) for lst in lists):  # the usual case, without a loop
        return range(len(lists[0])), []
    good, bad = [], []
    for i in range(len(lists[0])):
        (good if all(lst[i].is_contiguous() for lst in lists) else bad).append(i)
    return good, bad


def _checked_pair(inputs: list, outputs: list) -> list | None:
    """``[inputs, outputs]`` as the Columns that ``multi_tensor_scale``'s checks make of them (a set of
    tensors seen before costs one read of each tensor's address, size, dtype and layout, and nothing else), or
    None when the checks refuse them (strides the kernel does not pair, a dtype it does not take): those go
    the general way."""
    from apex._kernels._lists import checked
    from apex.ops._checks import check_tensor_lists

    lists = [inputs, outputs]
    try:
        return checked("scale", lists, lambda: check_tensor_lists(lists, 2))
    except (TypeError, ValueError, RuntimeError):
        return None


@torch.no_grad()
def scale_into(noop_flag: torch.Tensor, inputs: list, outputs: list, scale: float) -> list | None:
    """``outputs[i] = inputs[i] * scale`` with the non-finite flag, for any strides and dtypes.

    GPU tensors go through ``multi_tensor_scale`` (one Triton launch per dtype group); CPU tensors straight
    to ``torch._amp_foreach_non_finite_check_and_unscale_``, which takes any strides and mixed dtypes, so
    a step pays no per-tensor Python checks. Returns the lists as checked Columns where the kernel took them
    whole (their ``dtype`` facts are then at hand), else None.
    """
    if not inputs:
        return None
    if _backend.select(inputs) == "torch":
        _scale_into_torch(noop_flag, inputs, outputs, scale)
        return None
    cols = _checked_pair(inputs, outputs)
    if cols is not None:  # every pair in a layout the kernel pairs: one call (checked: trusted as they are)
        multi_tensor_scale(_CHUNK, noop_flag, cols, scale)
        return cols
    good, bad = _split_contiguous(inputs) if inputs is outputs else _split_contiguous(inputs, outputs)
    if not bad:  # the lists as they are (an in-place unscale passes one list twice: read once)
        multi_tensor_scale(_CHUNK, noop_flag, [inputs, outputs], scale)
    elif good:
        multi_tensor_scale(_CHUNK, noop_flag, [[inputs[i] for i in good], [outputs[i] for i in good]], scale)
    if bad:
        _scale_into_torch(noop_flag, [inputs[i] for i in bad], [outputs[i] for i in bad], scale)
    return None


def copy_masters_to_model(noop_flag: torch.Tensor, masters: list, model_params: list) -> None:
    """Round the fp32 masters into the half model parameters after a step.

    On CPUs a plain rounding copy (no scale, no check: the masters are finite after a taken step); on GPUs
    ``scale_into`` with a scale of 1 (one Triton launch per dtype group)."""
    if not model_params:
        return
    if _backend.select(model_params) == "torch":
        with torch.no_grad():
            torch._foreach_copy_(model_params, masters)
    else:
        scale_into(noop_flag, masters, model_params, 1.0)


def _scale_into_torch(noop_flag, inputs, outputs, scale: float) -> None:
    found = torch.zeros(1, dtype=torch.float32, device=noop_flag.device)
    scale_t = torch.full((1,), scale, dtype=torch.float32, device=noop_flag.device)
    # In place, or an exact copy into a type at least as wide: copy, then unscale the outputs in place
    # (PyTorch's op computes in fp32 and rounds once). A narrowing copy scales an fp32 temporary first.
    direct = [i for i, (x, o) in enumerate(zip(inputs, outputs))
              if x is o or o.dtype == torch.float32 or o.dtype == x.dtype]
    if len(direct) == len(inputs):
        copies = [i for i in direct if inputs[i] is not outputs[i]]
        if copies:
            torch._foreach_copy_([outputs[i] for i in copies], [inputs[i] for i in copies])
        torch._amp_foreach_non_finite_check_and_unscale_(list(outputs), found, scale_t)
    else:
        keep = set(direct)
        if direct:
            _scale_into_torch(noop_flag, [inputs[i] for i in direct], [outputs[i] for i in direct], scale)
        rest = [i for i in range(len(inputs)) if i not in keep]
        tmp = [inputs[i].float() for i in rest]
        tmp = [t.clone() if t is inputs[i] else t for t, i in zip(tmp, rest)]
        torch._amp_foreach_non_finite_check_and_unscale_(tmp, found, scale_t)
        torch._foreach_copy_([outputs[i] for i in rest], tmp)
    mark_found_inf(noop_flag, found)


class LossScaler:
    """Loss scale of one loss: dynamic (``loss_scale="dynamic"``) or a fixed number."""

    warned_no_fused_kernel = False
    warned_unscaling_non_fp32_grad = False
    has_fused_kernel = True

    def __init__(self, loss_scale, init_scale: float = 2.0 ** 16, scale_factor: float = 2.0,
                 scale_window: int = 2000, min_loss_scale: float | None = None,
                 max_loss_scale: float = 2.0 ** 24, device: torch.device | str | None = None):
        if loss_scale == "dynamic":
            self.dynamic = True
            self._loss_scale = float(init_scale)
        else:
            self.dynamic = False
            self._loss_scale = float(loss_scale)
        if not scale_window or int(scale_window) <= 0:
            raise ValueError(f"scale_window must be a positive int, got {scale_window!r}")
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = int(scale_window)
        self._scale_factor = float(scale_factor)
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_buf = torch.zeros(1, dtype=torch.int32, device=device or "cpu")

    def loss_scale(self) -> float:
        return self._loss_scale

    def _buf_for(self, tensors) -> torch.Tensor:
        # The flag lives where the gradients are; moving it happens at most once per device change.
        for t in tensors:
            if t is not None:
                if t.device != self._overflow_buf.device:
                    self._overflow_buf = self._overflow_buf.to(t.device)
                break
        return self._overflow_buf

    def _warn_non_fp32(self, master_grads, cols: list | None = None) -> None:
        """Warn once about non-fp32 ``master_grads``; ``cols``: the lists as ``scale_into`` checked them,
        whose dtype facts answer without reading the tensors again."""
        if LossScaler.warned_unscaling_non_fp32_grad:
            return
        if cols is not None and cols[1].dtype is torch.float32:
            return
        if set(map(_dtype, filter(_not_none, master_grads))) <= {torch.float32}:  # (no loop in Python)
            return
        for m in master_grads:
            if m is not None and m.dtype != torch.float32:
                warnings.warn(f"Attempting to unscale a grad with type {m.type()} "
                              "Unscaling non-fp32 grads may indicate an error. "
                              "When using Amp, you don't need to call .half() on your model.", stacklevel=3)
                LossScaler.warned_unscaling_non_fp32_grad = True
                return

    def unscale(self, model_grads, master_grads, unused_scale=None, models_are_masters: bool = False,
                scale_override: float | None = None) -> None:
        """``master_grads[i] = model_grads[i] / loss_scale`` (or ``/ scale_override``), flagging infs/NaNs in
        the model grads."""
        if self._has_overflow:
            return
        scale = self._loss_scale if scale_override is None else float(scale_override)
        if scale == 1.0 and models_are_masters and not self.dynamic:
            return
        if model_grads is master_grads and all(map(is_not, model_grads, repeat(None))):
            ins = outs = model_grads  # in place (amp O1): one list, read once
        else:
            pairs = [(a, b) for a, b in zip(model_grads, master_grads) if a is not None]
            ins, outs = [p[0] for p in pairs], [p[1] for p in pairs]
        if not ins:
            return
        cols = scale_into(self._buf_for(ins), ins, outs, 1.0 / scale)
        if scale_override is None:  # with an override (FusedSGD's half model grads) half grads are the plan
            self._warn_non_fp32(outs, cols)

    def unscale_with_stashed(self, model_grads, stashed_master_grads, master_grads, scale_override=None) -> None:
        """``master = model / loss_scale + stashed`` (gradient accumulation across backward passes).

        ``scale_override=(grads_have_scale, stashed_have_scale, out_scale)`` (Apex's): ``master = model *
        out/grads_have + stashed * out/stashed_have``, a sum kept at the scale ``out_scale``. Only the incoming
        ``model_grads`` are checked for infs/NaNs, as in Apex's ``axpby`` kernel.
        """
        if self._has_overflow:
            return
        triples = [(m, s, o) for m, s, o in zip(model_grads, stashed_master_grads, master_grads)
                   if not (m is None and s is None)]
        if not triples:
            return
        buf = self._buf_for([t[0] for t in triples])
        inv, b = 1.0 / self._loss_scale, 1.0
        if scale_override is not None:
            grads_have, stashed_have, out = (float(v) for v in scale_override)
            inv, b = out / grads_have, out / stashed_have
        ms, ss, outs = ([t[i] for t in triples] for i in range(3))
        cpu = _backend.select(ms) == "torch"
        good, bad = ([], list(range(len(ms)))) if cpu else _split_contiguous(ms, ss, outs)
        if good:
            # out = inv * model + b * stashed in fp32, checking only the model grads (arg 0).
            multi_tensor_axpby(_CHUNK, buf, [[ms[i] for i in good], [ss[i] for i in good],
                                             [outs[i] for i in good]], inv, b, 0)
        if bad:
            tmp = [ms[i].float() for i in bad]
            tmp = [t.clone() if t is ms[i] else t for t, i in zip(tmp, bad)]
            _scale_into_torch(buf, tmp, tmp, inv)
            with torch.no_grad():
                torch._foreach_add_(tmp, [ss[i].float() for i in bad], alpha=b)
                torch._foreach_copy_([outs[i] for i in bad], tmp)

    def clear_overflow_state(self) -> None:
        self._has_overflow = False
        self._overflow_buf.zero_()

    def update_scale(self) -> bool:
        """Read the overflow flag (the step's one host sync), adjust the scale, return "skip the step"."""
        if self.dynamic and not self._has_overflow:
            self._has_overflow = bool(self._overflow_buf.item())
        if self._has_overflow and self.dynamic:
            should_skip = True
            if self._min_loss_scale:
                self._loss_scale = max(self._min_loss_scale, self._loss_scale / self._scale_factor)
            else:
                self._loss_scale = self._loss_scale / self._scale_factor
            self._unskipped = 0
        else:
            should_skip = False
            self._unskipped += 1
        if self._unskipped == self._scale_seq_len and self.dynamic:
            self._loss_scale = min(self._max_loss_scale, self._loss_scale * self._scale_factor)
            self._unskipped = 0
        return should_skip
