"""Apex's legacy ``fused_adam_cuda`` operations (used by ``apex.contrib.optimizers.FusedAdam``, fairseq's
``FusedAdamV1`` and the first distributed Adam), with Apex's positional signatures.

Math, per element, in fp32 (fp64 when the parameter is fp64), whatever the storage dtypes::

    g = grad / grad_scale
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = sqrt(v + eps)  (mode 0, "eps inside sqrt")   or   sqrt(v) + eps  (mode 1)
    step_size = lr * sqrt(1 - beta2**step) / (1 - beta1**step)   (lr without bias correction)
    p = p - step_size * (m / denom + decay * p)

Unlike ``multi_tensor_adam`` the bias corrections scale the step, not ``v`` (so eps is not bias-corrected)
and ``decay`` is scaled by the step size: this is Apex's legacy formula, kept bit-for-bit in its order of
operations. ``p_copy`` (may be empty) receives the new parameter rounded to its own dtype; a ``uint8``
``p_copy`` holds Apex's e5m2 encoding (the high byte of fp16 after rounding half away from zero in
magnitude). ``overflow_flag`` is a one-element int tensor read on the device (no host synchronisation).

Implementation: PyTorch elementwise and foreach-free operations per tensor (no Triton kernel); the tensors
are updated in place outside autograd. Apex's CUDA kernels require contiguous tensors; these accept any
layout.
"""

from __future__ import annotations

import math

import torch

__all__ = ["adam", "reversible_adam", "adam_mt", "maybe_adam_undo", "maybe_cast", "maybe_cast_mt",
           "strided_check_finite"]

_SIGN_EXP_MASK = -8388608  # 0xFF800000 as int32: sign and exponent bits of an fp32


def _math_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float64 if p.dtype == torch.float64 else torch.float32


def _check_same_numel(p: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if t.numel() != p.numel():
            raise ValueError(f"number of elements in {name} ({t.numel()}) and p ({p.numel()}) should be equal")


def _check_mode(mode: int) -> None:
    if int(mode) not in (0, 1):
        raise ValueError(f"mode must be 0 (eps inside sqrt) or 1 (eps outside sqrt), got {mode}")


def _step_size(lr: float, beta1: float, beta2: float, step: int, bias_correction: int) -> float:
    if bias_correction:
        return lr * math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
    return lr


def encode_e5m2(x: torch.Tensor) -> torch.Tensor:
    """Apex's float -> e5m2 byte: add 1/8 of the value's power of two, round to fp16, keep the high byte."""
    x32 = x.to(torch.float32)
    pow2 = (x32.view(torch.int32) & _SIGN_EXP_MASK).view(torch.float32)
    h = (x32 + pow2 / 8.0).to(torch.float16).view(torch.int16).to(torch.int32)
    return ((h >> 8) & 0xFF).to(torch.uint8)


def decode_e5m2(b: torch.Tensor) -> torch.Tensor:
    """e5m2 byte -> fp16 (the byte is the high byte of an fp16 whose low byte is zero)."""
    word = b.to(torch.int32) << 8
    word = torch.where(word >= 32768, word - 65536, word)
    return word.to(torch.int16).view(torch.float16)


def _cast_into(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``src`` converted to ``dst``'s storage type (e5m2 for uint8), shaped like ``dst``."""
    src = src.reshape(dst.shape)
    if dst.dtype == torch.uint8:
        return encode_e5m2(src)
    if src.dtype == torch.uint8:
        return decode_e5m2(src).to(dst.dtype)
    return src.to(dst.dtype)


def _nonfinite(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.uint8:  # e5m2: exponent bits all ones
        return (t & 0x7C) == 0x7C
    return ~torch.isfinite(t)


def _adam_one(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay, *,
              reversible: bool) -> None:
    _check_same_numel(p, m=m, v=v, g=g)
    if p_copy.numel() not in (0, p.numel()):
        raise ValueError("number of elements in p_copy and p tensors should be equal, or p_copy should be empty")
    _check_mode(mode)
    step_size = _step_size(float(lr), float(beta1), float(beta2), int(step), int(bias_correction))
    dt = _math_dtype(p)
    beta1, beta2, eps, decay = float(beta1), float(beta2), float(eps), float(decay)
    p32, m32, v32 = p.to(dt), m.to(dt).reshape(p.shape), v.to(dt).reshape(p.shape)
    g32 = g.to(dt).reshape(p.shape) / float(grad_scale)
    m_new = beta1 * m32 + (1.0 - beta1) * g32
    v_new = beta2 * v32 + (1.0 - beta2) * g32 * g32
    denom = torch.sqrt(v_new + eps) if int(mode) == 0 else torch.sqrt(v_new) + eps
    p_new = p32 - step_size * (m_new / denom + decay * p32)
    if reversible:  # elements with a non-finite gradient are left untouched (and flagged below)
        finite = torch.isfinite(g32)
        m_new = torch.where(finite, m_new, m32)
        v_new = torch.where(finite, v_new, v32)
        p_new = torch.where(finite, p_new, p32)
    m.copy_(m_new.reshape(m.shape))
    v.copy_(v_new.reshape(v.shape))
    p.copy_(p_new)
    if p_copy.numel():
        p_copy.copy_(_cast_into(p_new, p_copy))
        if reversible:
            # Apex marks an overflowing step by writing inf into the copy's first element
            first = (0,) * p_copy.dim()
            inf = _cast_into(torch.full((), math.inf, device=p.device), p_copy[first])
            p_copy[first] = torch.where((~finite).any(), inf, p_copy[first])


@torch.no_grad()
def adam(p: torch.Tensor, p_copy: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, lr: float,
         beta1: float, beta2: float, eps: float, grad_scale: float, step: int, mode: int, bias_correction: int,
         decay: float) -> None:
    """One legacy Adam step on one tensor (see the module docstring); infs and NaNs propagate."""
    _adam_one(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay,
              reversible=False)


@torch.no_grad()
def reversible_adam(p: torch.Tensor, p_copy: torch.Tensor, m: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    lr: float, beta1: float, beta2: float, eps: float, grad_scale: float, step: int, mode: int,
                    bias_correction: int, decay: float) -> None:
    """``adam`` that skips elements whose scaled gradient is not finite and then writes inf into
    ``p_copy[0]`` (so ``strided_check_finite`` sees the overflow and ``maybe_adam_undo`` can revert)."""
    _adam_one(p, p_copy, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode, bias_correction, decay,
              reversible=True)


@torch.no_grad()
def adam_mt(chunk_size: int, overflow_flag: torch.Tensor, tensor_lists, lr: float, beta1: float, beta2: float,
            eps: float, grad_scale: float, step: int, mode: int, bias_correction: int, decay: float) -> None:
    """``adam`` over ``tensor_lists = [params, exp_avgs, exp_avg_sqs, grads(, p_copies)]``; like Apex's
    kernel it does not read ``overflow_flag``."""
    if len(tensor_lists) not in (4, 5):
        raise ValueError(f"tensor_lists must hold 4 or 5 lists, got {len(tensor_lists)}")
    n = len(tensor_lists[0])
    if any(len(lst) != n for lst in tensor_lists):
        raise ValueError("tensor_lists: every list must have the same length")
    copies = tensor_lists[4] if len(tensor_lists) == 5 else [None] * n
    empty = torch.empty(0)
    for p, m, v, g, c in zip(*tensor_lists[:4], copies):
        _adam_one(p, empty if c is None else c, m, v, g, lr, beta1, beta2, eps, grad_scale, step, mode,
                  bias_correction, decay, reversible=False)


@torch.no_grad()
def maybe_adam_undo(overflow_flag: torch.Tensor, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float, grad_scale: float,
                    step: int, mode: int, bias_correction: int, decay: float) -> None:
    """When ``overflow_flag`` is set, invert the ``reversible_adam`` step for the elements whose scaled
    gradient is finite (``v`` clamped at 0 against round-off); otherwise change nothing."""
    _check_same_numel(p, m=m, v=v, g=g)
    _check_mode(mode)
    step_size = _step_size(float(lr), float(beta1), float(beta2), int(step), int(bias_correction))
    beta1, beta2, eps, decay = float(beta1), float(beta2), float(eps), float(decay)
    dt = _math_dtype(p)
    p32, m32, v32 = p.to(dt), m.to(dt).reshape(p.shape), v.to(dt).reshape(p.shape)
    g32 = g.to(dt).reshape(p.shape) / float(grad_scale)
    denom = torch.sqrt(v32 + eps) if int(mode) == 0 else torch.sqrt(v32) + eps
    p_old = (p32 + step_size * (m32 / denom)) / (1.0 - step_size * decay)
    m_old = (m32 - (1.0 - beta1) * g32) / beta1
    v_old = torch.clamp_min((v32 - (1.0 - beta2) * g32 * g32) / beta2, 0.0)
    undo = torch.isfinite(g32) & (overflow_flag.reshape(()) != 0)
    p.copy_(torch.where(undo, p_old, p32))
    m.copy_(torch.where(undo, m_old, m32).reshape(m.shape))
    v.copy_(torch.where(undo, v_old, v32).reshape(v.shape))


@torch.no_grad()
def maybe_cast(overflow_flag: torch.Tensor, p_in: torch.Tensor, p_out: torch.Tensor) -> None:
    """``p_out = p_in`` converted to ``p_out``'s dtype (uint8 = e5m2, either side) unless ``overflow_flag``
    is set."""
    _check_same_numel(p_in, p_out=p_out)
    skip = overflow_flag.reshape(()) != 0
    p_out.copy_(torch.where(skip, p_out, _cast_into(p_in, p_out)))


@torch.no_grad()
def maybe_cast_mt(chunk_size: int, overflow_flag: torch.Tensor, tensor_lists) -> None:
    """``maybe_cast`` over ``tensor_lists = [inputs, outputs]``."""
    if len(tensor_lists) != 2 or len(tensor_lists[0]) != len(tensor_lists[1]):
        raise ValueError("tensor_lists must be [inputs, outputs] of equal length")
    for p_in, p_out in zip(*tensor_lists):
        maybe_cast(overflow_flag, p_in, p_out)


@torch.no_grad()
def strided_check_finite(overflow_flag: torch.Tensor, p_copy: torch.Tensor, stride: int,
                         clear_overflow_first: int) -> None:
    """Set ``overflow_flag`` to 1 if any of ``p_copy.flatten()[::stride]`` is inf or NaN (e5m2 for uint8);
    with ``clear_overflow_first`` the flag is reset to 0 first, otherwise a set flag stays set."""
    if int(stride) < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    bad = _nonfinite(p_copy.reshape(-1)[:: int(stride)]).any()
    if not clear_overflow_first:
        bad = bad | (overflow_flag.reshape(()) != 0)
    overflow_flag.copy_(bad.to(overflow_flag.dtype).reshape(overflow_flag.shape))
