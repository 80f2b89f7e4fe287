"""Megatron-LM's fused scale-mask-softmax (Apex's ``apex.transformer.functional.fused_softmax``).

``probs = softmax(scale · scores)`` over the keys of ``[b, np, sq, sk]`` attention scores, with a boolean
padding mask (True = masked, ``[b or 1, 1, sq, sk]``) or the causal (upper-triangular) mask. Softmax in
fp32, probabilities in the input dtype; a row whose keys are all masked gives zeros, never NaN.

Differences from upstream: the fused path takes every shape, fp32 included (upstream needs fp16/bf16,
16 < sk ≤ 16384 and sq, sk, b·np divisible by 4); :meth:`FusedScaleMaskSoftmax.is_kernel_available` is
therefore True whenever fusion is asked for (causal needs sq == sk). ``GenericFusedScaleMaskSoftmax``
honours ``scaled_masked_softmax_fusion=False`` (upstream's then fails) and fuses with the generic kernel.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from apex._errors import AssertValueError, RuntimeValueError
from apex.ops import scaled_masked_softmax as _ops
from apex.ops._dispatch import _PLAIN
from apex.ops._norm import autocast_args
from apex.transformer.enums import AttnMaskType

__all__ = [
    "FusedScaleMaskSoftmax",
    "GenericFusedScaleMaskSoftmax",
    "GenericScaledMaskedSoftmax",
    "ScaledMaskedSoftmax",
    "ScaledSoftmax",
    "ScaledUpperTriangMaskedSoftmax",
    "generic_scaled_masked_softmax",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
]

Tensor = torch.Tensor


# ------------------------------------------------------------------------------- autograd Functions
class ScaledUpperTriangMaskedSoftmax(torch.autograd.Function):
    """Scale, causal mask, softmax of 3-D ``[b·np, sq, sk]`` scores (``sq == sk``)."""

    @staticmethod
    def forward(ctx, inputs, scale):
        probs = _ops.upper_triang_forward(inputs, scale)
        ctx.scale = _ops.check_scale(scale)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, output_grads):
        (probs,) = ctx.saved_tensors
        return _ops.upper_triang_backward(output_grads, probs, ctx.scale), None


class ScaledMaskedSoftmax(torch.autograd.Function):
    """Scale, padding mask (``[b or 1, 1, sq, sk]``, True = masked), softmax of 4-D scores."""

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        probs = _ops.masked_softmax_forward(inputs, mask, scale)
        ctx.scale = _ops.check_scale(scale)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, output_grads):
        (probs,) = ctx.saved_tensors
        return _ops.masked_softmax_backward(output_grads, probs, ctx.scale), None, None


class GenericScaledMaskedSoftmax(torch.autograd.Function):
    """:class:`ScaledMaskedSoftmax` through ``generic_scaled_masked_softmax_cuda`` (no sk limit upstream)."""

    @staticmethod
    def forward(ctx, inputs, mask, scale):
        probs = _ops.generic_forward(inputs, mask, scale)
        ctx.scale = _ops.check_scale(scale)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, output_grads):
        (probs,) = ctx.saved_tensors
        return _ops.generic_backward(output_grads, probs, ctx.scale), None, None


class ScaledSoftmax(torch.autograd.Function):
    """Scale and softmax of 4-D scores, no mask."""

    @staticmethod
    def forward(ctx, inputs, scale):
        probs = _ops.softmax_forward(inputs, scale)
        ctx.scale = _ops.check_scale(scale)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, output_grads):
        (probs,) = ctx.saved_tensors
        return _ops.softmax_backward(output_grads, probs, ctx.scale), None


# ---------------------------------------------------------------------------------------- functions
# They go through apex's differentiable custom op (the same kernels as the Functions above), which
# torch.compile traces without a graph break. Under autocast the scores are first cast to the autocast
# dtype, as upstream's ``_cast_if_autocast_enabled`` does.
def _autocast(inputs: object) -> object:
    """``inputs`` cast as upstream's ``_cast_if_autocast_enabled`` does; with autocast off everywhere (one
    query) no device object is built."""
    if _autocast_on() and isinstance(inputs, torch.Tensor):
        return autocast_args(inputs.device.type, inputs)[0]
    return inputs


_autocast_on = torch._C._is_any_autocast_enabled


def _check_4d(inputs: object, name: str = "inputs") -> None:
    # Apex's extensions refused other ranks with a RuntimeError ("expected 4D tensor"); its causal function
    # unpacked four sizes first (a ValueError).
    if isinstance(inputs, torch.Tensor) and inputs.dim() != 4:
        raise RuntimeValueError(f"{name} must be a 4-D [b, np, sq, sk] tensor of attention scores, got shape "
                                f"{list(inputs.shape)}")


# The planned eager path (apex.ops._softmax_direct, the op's ``_lean``) is tried first where a hit stands for
# every check below: a plan is made only for scores that ``check_args`` passes with its ``causal`` (a floating
# dtype, 3-D or 4-D, sq == sk when causal, the mask's facts; with ``checked`` it is not asked, but a key whose
# dtype the kernels do not take, a floating one included, is never planned), so what its key does not cover is
# checked here first, in these functions' order: a plain tensor (before its shape is read; a subclass takes the
# general path anyway), 4-D (the op plans 3-D scores too), the causal sq == sk (this function's error, before
# check_args'), and autocast off (a plan runs on the scores as given; autocast casts them first). A miss (None:
# not planned, another backend, a mode or transform) has changed nothing: the checks, then the op's general
# path without its lean lookup again (``_run``: what scaled_masked_softmax[_checked] runs after a miss).
def scaled_upper_triang_masked_softmax(inputs: Tensor, _: object, scale: float) -> Tensor:
    """Causal softmax of ``[b, np, sq, sk]`` scores (``sq == sk``, else ``ValueError``, also the
    ``AssertionError`` Apex raised); the second argument is ignored."""
    tried = False
    if type(inputs) in _PLAIN and not _autocast_on():
        shape = inputs.shape
        if len(shape) == 4 and shape[2] == shape[3]:
            out = _ops._lean(inputs, None, scale, True, True)
            if out is not None:
                return out
            tried = True
    _check_4d(inputs)
    if isinstance(inputs, torch.Tensor):
        shape = inputs.shape  # one read (.size(i) costs as much as .shape, twice)
        if shape[-2] != shape[-1]:
            raise AssertValueError(f"causal mask is only for self attention: inputs must have sq == sk, got shape "
                                   f"{list(shape)}")
    _ops.check_args(inputs, None, True, "inputs")
    if tried:  # (autocast off: the scores as given)
        return _ops._run(inputs, None, _ops.check_scale(scale), True)
    # Checked once: autocast's cast keeps what check_args looked at (a floating 4-D tensor, its device).
    return _ops.scaled_masked_softmax_checked(_autocast(inputs), None, scale, True)


def scaled_masked_softmax(inputs: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """Padding-masked softmax of ``[b, np, sq, sk]`` scores; ``mask=None`` is :func:`scaled_softmax`."""
    if type(inputs) in _PLAIN and not _autocast_on() and inputs.dim() == 4:
        # The op's own entry, inline (a frame less): its lean path (a miss checks, with the op's errors, as the
        # op called below would), then its checks and general path.
        out = _ops._lean(inputs, mask, scale, False, False)
        if out is None:
            _ops.check_args(inputs, mask, False)
            out = _ops._run(inputs, mask, _ops.check_scale(scale), False)
        return out
    _check_4d(inputs)
    return _ops.scaled_masked_softmax(_autocast(inputs), mask, scale)


def scaled_softmax(inputs: Tensor, scale: float) -> Tensor:
    """Softmax of ``scale ·`` ``[b, np, sq, sk]`` scores, no mask."""
    return scaled_masked_softmax(inputs, None, scale)


def generic_scaled_masked_softmax(inputs: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """:func:`scaled_masked_softmax` (upstream's variant without the sk limit; ours has none anyway)."""
    return scaled_masked_softmax(inputs, mask, scale)


# -------------------------------------------------------------------------------------------- modules
class FusedScaleMaskSoftmax(torch.nn.Module):
    """Fused scaling + mask + softmax of ``[b, np, sq, sk]`` attention scores.

    Arguments (as upstream): ``input_in_fp16`` / ``input_in_bf16`` (the score dtype; not both),
    ``attn_mask_type`` (:class:`AttnMaskType`), ``scaled_masked_softmax_fusion`` (use the fused kernel),
    ``mask_func(scores, mask)`` (the unfused path's masking), ``softmax_in_fp32`` (unfused path: upcast),
    ``scale`` (None = 1; needs ``softmax_in_fp32``).
    """

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, attn_mask_type: AttnMaskType,
                 scaled_masked_softmax_fusion: bool, mask_func: Callable[[Tensor, Tensor], Tensor] | None,
                 softmax_in_fp32: bool, scale: float | None):
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise RuntimeError("both fp16 and bf16 flags cannot be active at the same time.")
        if not (scale is None or softmax_in_fp32):
            raise RuntimeError("softmax should be in fp32 when scaled")
        if scale is not None:
            _ops.check_scale(scale)
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        if attn_mask_type == AttnMaskType.causal:
            self.fused_softmax_func = scaled_upper_triang_masked_softmax
        elif attn_mask_type == AttnMaskType.padding:
            self.fused_softmax_func = scaled_masked_softmax
        elif scaled_masked_softmax_fusion:
            raise ValueError(f"Invalid attn_mask_type: expected AttnMaskType.causal or AttnMaskType.padding, "
                             f"got {attn_mask_type!r}")

    def forward(self, input: Tensor, mask: Tensor | None) -> Tensor:
        if not isinstance(input, torch.Tensor) or input.dim() != 4:  # Apex: assert input.dim() == 4
            got = list(input.shape) if isinstance(input, torch.Tensor) else type(input).__name__
            raise AssertValueError(f"input must be a 4-D [b, np, sq, sk] tensor of attention scores, got {got}")
        if self.is_kernel_available(mask, *input.size()):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask: Tensor | None, b: int, np: int, sq: int, sk: int) -> bool:
        """Whether :meth:`forward` takes the fused path: fusion asked for, a known mask type, and for the
        causal kernel ``sq == sk``. Upstream's dtype and size limits do not apply (see
        :meth:`get_batch_per_block` for upstream's block shape, a performance hint only)."""
        if not self.scaled_masked_softmax_fusion or sk <= 0:
            return False
        if self.attn_mask_type == AttnMaskType.causal:
            return sq == sk
        return self.attn_mask_type == AttnMaskType.padding

    def forward_fused_softmax(self, input: Tensor, mask: Tensor | None) -> Tensor:
        scale = self.scale if self.scale is not None else 1.0
        return self.fused_softmax_func(input, mask, scale)

    def forward_torch_softmax(self, input: Tensor, mask: Tensor | None) -> Tensor:
        upcast = self.input_in_float16 and self.softmax_in_fp32
        if upcast:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        masked = self.mask_func(input, mask) if mask is not None else input
        probs = torch.softmax(masked, dim=-1)
        if upcast:
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs

    @staticmethod
    def get_batch_per_block(sq: int, sk: int, b: int, np: int) -> int:
        return _ops.get_batch_per_block(sq, sk, b, np)


class GenericFusedScaleMaskSoftmax(FusedScaleMaskSoftmax):
    """:class:`FusedScaleMaskSoftmax` with a padding mask through the generic kernel (any ``sk ≥ 1``)."""

    def __init__(self, input_in_fp16: bool, input_in_bf16: bool, scaled_masked_softmax_fusion: bool,
                 mask_func: Callable[[Tensor, Tensor], Tensor] | None, softmax_in_fp32: bool,
                 scale: float | None):
        super().__init__(input_in_fp16, input_in_bf16, AttnMaskType.padding, scaled_masked_softmax_fusion,
                         mask_func, softmax_in_fp32, scale)
        self.fused_softmax_func = generic_scaled_masked_softmax

    def is_kernel_available(self, mask: Tensor | None, b: int, np: int, sq: int, sk: int) -> bool:
        return bool(self.scaled_masked_softmax_fusion) and sk > 0
