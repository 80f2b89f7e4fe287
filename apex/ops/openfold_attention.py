"""OpenFold attention with a key mask and an additive bias:
``o = softmax(q·kᵀ/√d + (mask − 1)·inf + bias) · v``.

Shapes: ``q`` ``[..., H, NQ, D]``, ``k``/``v`` ``[..., H, NK, D]`` with the same leading dims; ``mask`` and
``bias`` broadcastable to ``[..., H, NQ, NK]`` (OpenFold: mask ``[1, B, 1, 1, NK]`` of 0/1, bias
``[1, 1, H, NQ, NK]``). Gradients flow to ``q``, ``k``, ``v`` and ``bias`` (summed over its broadcast
dimensions); the mask gets none.

Dtype policy: scores, softmax statistics and accumulation in fp32, outputs and gradients in the inputs'
dtypes. Paths: CUDA/ROCm tensors run the flash-attention kernels of ``apex._kernels.openfold_attention``
(the mask and bias read through broadcast strides, never expanded, and the ``[*, H, NQ, NK]`` probabilities
never stored in the forward); CPU tensors run ``baddbmm`` (q·kᵀ/√d plus the mask and bias folded into one
additive term; for fp16/bf16 the masking term is clamped to the dtype's finite range), softmax and ``bmm``.
"""

from __future__ import annotations

import math

import torch

from apex import _backend

Tensor = torch.Tensor


def check_args(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> tuple:
    """Validate shapes, dtypes and devices; returns the full score shape ``[..., H, NQ, NK]``."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.dim() < 3:
            raise ValueError(f"{name} must have at least 3 dims [..., heads, length, head_dim], got {list(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"query, key and value must share a device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"key and value must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if k.shape[:-2] != q.shape[:-2] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"key shape {list(k.shape)} does not match query shape {list(q.shape)} "
                         "(same leading dims and head dim expected)")
    full = (*q.shape[:-1], k.shape[-2])
    for name, t in (("mask", mask), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, query on {q.device}")
        try:
            ok = torch.broadcast_shapes(t.shape, full) == full
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} of shape {list(t.shape)} does not broadcast to the scores {list(full)}")
    return full


# ---------------------------------------------------------------------------------------------- torch
def _attention_torch(q, k, v, mask, bias, inf):
    # baddbmm adds the mask and bias while computing q·kᵀ; on CPUs this beat scaled_dot_product_attention
    # with a float mask by ~1.5x (N = 128, D = 32), whose backward is also slower.
    z = math.prod(q.shape[:-2])
    nq, nk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    full = tuple(q.shape[:-1]) + (nk,)
    add = None
    if mask is not None:
        lim = min(float(inf), torch.finfo(q.dtype).max)
        add = (mask.detach().to(q.dtype) - 1.0) * lim
    if bias is not None:
        add = bias.to(q.dtype) if add is None else add + bias.to(q.dtype)
    q3, k3, v3 = q.reshape(z, nq, d), k.reshape(z, nk, d), v.reshape(z, nk, d)
    if add is None:
        a = torch.bmm(q3, k3.transpose(1, 2)).mul_(1.0 / math.sqrt(d))
    else:
        a = torch.baddbmm(add.expand(full).reshape(z, nq, nk), q3, k3.transpose(1, 2), alpha=1.0 / math.sqrt(d))
    return torch.bmm(torch.softmax(a, dim=-1), v3).reshape(q.shape)


# --------------------------------------------------------------------------------------------- triton
def _as4(t: Tensor | None, full: tuple, z: int, dtype: torch.dtype | None = None) -> Tensor | None:
    """A ``[Z, H, NQ, NK]`` view with broadcast strides (a copy only when the strides cannot merge)."""
    if t is None:
        return None
    if dtype is not None and t.dtype == torch.bool:
        t = t.to(dtype)
    e = t.expand(full)
    try:
        return e.view(z, *full[-3:])
    except RuntimeError:
        return e.reshape(z, *full[-3:])


def _triton_forward(q, k, v, mask, bias, inf, full) -> tuple[Tensor, tuple, float]:
    """``(output, tensors the backward needs, scale)`` of the Triton path."""
    from apex._kernels import openfold_attention as kernels

    if q.dim() == 4:  # [Z, H, N, D] already: no reshapes (an operator call each)
        z, q4, k4, v4 = q.shape[0], q, k, v
    else:
        z = math.prod(q.shape[:-3])
        q4, k4, v4 = q.reshape(z, *q.shape[-3:]), k.reshape(z, *k.shape[-3:]), v.reshape(z, *v.shape[-3:])
    m4 = _as4(mask, full, z, q.dtype)
    b4 = _as4(bias, full, z)
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = kernels.forward(q4, k4, v4, m4, b4, scale, float(inf))
    return (o if q4 is q else o.view(q.shape)), (q4, k4, v4, o, lse, m4, b4), scale


class _AttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, inf, full):
        out, saved, scale = _triton_forward(q, k, v, mask, bias, inf, full)
        ctx.save_for_backward(*saved)
        ctx.meta = (q.shape, k.shape, full, bias.shape if bias is not None else None, scale, float(inf))
        return out

    @staticmethod
    def backward(ctx, do):
        from apex._kernels import openfold_attention as kernels

        q4, k4, v4, o, lse, m4, b4 = ctx.saved_tensors
        q_shape, k_shape, full, bias_shape, scale, inf = ctx.meta
        need_ds = b4 is not None and ctx.needs_input_grad[4]
        four = len(q_shape) == 4
        do4 = (do if four else do.reshape(o.shape)).contiguous()
        dq, dk, dv, ds = kernels.backward(do4, q4, k4, v4, m4, b4, o, lse, scale, inf, need_ds)
        dbias = None
        if need_ds:
            dbias = ds.view(full).sum_to_size(bias_shape).to(b4.dtype)
        if four:
            return dq, dk, dv, None, dbias, None, None
        return dq.view(q_shape), dk.view(k_shape), dv.view(k_shape), None, dbias, None, None


# ------------------------------------------------------------------------------------------- entry
def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None, bias: Tensor | None = None,
              inf: float = 1e9) -> Tensor:
    """Differentiable masked, biased attention (see the module docstring); returns ``[..., H, NQ, D]``."""
    full = check_args(query, key, value, mask, bias)
    if not isinstance(inf, (int, float)) or not inf > 0:
        raise ValueError(f"inf must be a positive number, got {inf!r}")
    if _backend.select(query, key, value) == "triton" and query.dtype != torch.float64:
        # Outside torch.func transforms and tracing, the C++ Function.apply without its Python wrapper
        # (which unwraps torch.func's dead wrappers, ~4 µs).
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return _AttentionTriton.apply(query, key, value, mask, bias, float(inf), full)
        if not (torch.is_grad_enabled() and torch._C._any_requires_grad(query, key, value, bias)):
            # Nothing to record: the kernels alone, without the Function's context and saved tensors.
            return _triton_forward(query, key, value, mask, bias, float(inf), full)[0]
        return _triton_apply(query, key, value, mask, bias, float(inf), full)
    return _attention_torch(query, key, value, mask, bias, inf)


_triton_apply = super(torch.autograd.Function, _AttentionTriton).apply
