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
from apex.ops._checks import member_set
from apex.ops._openfold_attention_direct import Lean

Tensor = torch.Tensor


def check_args(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None) -> tuple:
    """Validate shapes, dtypes and devices; returns the full score shape ``[..., H, NQ, NK]``."""
    # The usual call, each fact read once: dtypes by identity (singletons), devices by flags and index (no
    # torch.device objects, ~1.5k instructions each); anything else goes through the checks below.
    if isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor):
        dt = q.dtype
        if dt in _FLOATS and k.dtype is dt and v.dtype is dt and _same_devices(q, k, v):
            qs, ks = q.shape, k.shape
            # what the checks below ask of q, k, v
            if len(qs) >= 3 and ks == v.shape and ks[-1] == qs[-1] and ks[:-2] == qs[:-2]:
                if mask is None and bias is None:
                    return (*qs[:-1], ks[-2])
                return _check_mask_bias(q, mask, bias, (*qs[:-1], ks[-2]))
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
    return _check_mask_bias(q, mask, bias, (*q.shape[:-1], k.shape[-2]))


_FLOATS = member_set(torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _same_devices(q: Tensor, k: Tensor, v: Tensor) -> bool:
    if q.is_cuda:
        i = q.get_device()
        return k.is_cuda and v.is_cuda and k.get_device() == i and v.get_device() == i
    return q.is_cpu and k.is_cpu and v.is_cpu


def _check_mask_bias(q: Tensor, mask: Tensor | None, bias: Tensor | None, full: tuple) -> tuple:
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
def _merged(sizes, strides) -> int | None:
    """The stride that steps through leading dims of ``sizes``/``strides`` as one (0 when they hold one
    element), or None when no single stride does."""
    merged = None
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if merged is not None and stride != merged[0] * merged[1]:
            return None
        merged = (stride, size) if merged is None else (merged[0], merged[1] * size)
    return 0 if merged is None else merged[0]


def _as4_strides(t: Tensor, lead: int) -> tuple | None:
    """``t``'s strides as ``[Z, H, N, D]`` (its ``lead`` leading dims merged into Z), or None."""
    st = t.stride()
    if lead == 1:  # 4-D: the kernels' layout
        return st
    if t.is_contiguous():  # Z steps over whole [H, N, D] blocks (size-1 dims may carry any stride)
        h, n, d = t.shape[lead:]
        return (h * n * d, *st[lead:])
    z = _merged(t.shape[:lead], st[:lead])
    return None if z is None else (z, *st[lead:])


def _broadcast_strides(t: Tensor, full: tuple) -> tuple | None:
    """The ``[Z, H, NQ, NK]`` strides reading ``t`` broadcast to ``full`` (0 along broadcast dims), or None
    when its leading dims do not merge into one stride."""
    pad = len(full) - t.dim()
    st = [0] * pad + [s if n != 1 else 0 for n, s in zip(t.shape, t.stride())]
    lead = len(full) - 3
    z = _merged(full[:lead], st[:lead])
    return None if z is None else (z, *st[lead:])


def _as4(t: Tensor, full: tuple, z: int) -> Tensor:
    """A ``[Z, H, NQ, NK]`` view with broadcast strides (a copy only when the strides cannot merge)."""
    e = t.expand(full)
    try:
        return e.view(z, *full[-3:])
    except RuntimeError:
        return e.reshape(z, *full[-3:])


def _operands(q, k, v, mask, bias, full) -> tuple:
    """``(q, k, v, mask, bias, dims, strides)`` for the kernels: the tensors as given whenever their leading
    dims merge into one (strides computed, no view: an operator call each), else reshaped to 4-D; ``dims`` is
    ``(Z, H, NQ, NK, D)``, ``strides`` the 20 strides of the five as ``[Z, H, N, *]`` (0 for an absent one)."""
    lead = len(full) - 3
    z = full[0] if lead == 1 else math.prod(full[:lead])
    if mask is None and bias is None and q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        # The usual unmasked call on contiguous inputs: the strides their layout implies (no stride reads).
        h, nq, nk, d = full[-3], full[-2], full[-1], q.shape[-1]
        sk = (h * nk * d, nk * d, d, 1)
        return q, k, v, None, None, (z, h, nq, nk, d), (h * nq * d, nq * d, d, 1, *sk, *sk, 0, 0, 0, 0, 0, 0, 0, 0)
    if mask is not None and mask.dtype == torch.bool:
        mask = mask.to(q.dtype)
    parts = []
    for t in (q, k, v):
        st = _as4_strides(t, lead)
        if st is None:
            t = t.reshape(z, *t.shape[lead:])
            st = t.stride()
        parts.append((t, st))
    for t in (mask, bias):
        if t is None:
            parts.append((None, (0, 0, 0, 0)))
            continue
        st = _broadcast_strides(t, full)
        if st is None:
            t = _as4(t, full, z)
            st = t.stride()
        parts.append((t, st))
    dims = (z, full[-3], full[-2], full[-1], q.shape[-1])
    return (*(t for t, _ in parts), dims, (*parts[0][1], *parts[1][1], *parts[2][1], *parts[3][1], *parts[4][1]))


_KERNELS: list = []


def _kernels():
    """``apex._kernels.openfold_attention``, imported on first use (an import statement costs ~1 µs a call)."""
    if not _KERNELS:
        from apex._kernels import openfold_attention

        _KERNELS.append(openfold_attention)
    return _KERNELS[0]


def _triton_forward(q, k, v, mask, bias, inf, full) -> tuple[Tensor, tuple, tuple]:
    """``(output in q's shape, tensors the backward needs, (dims, strides, scale))`` of the Triton path."""
    kernels = _kernels()
    q_, k_, v_, m_, b_, dims, strides = _operands(q, k, v, mask, bias, full)
    scale = 1.0 / math.sqrt(q.shape[-1])
    o, lse = kernels.forward(q_, k_, v_, m_, b_, scale, float(inf), dims, strides)
    # o is contiguous in q_'s shape: q's, unless q's leading dims had to be reshaped.
    return (o if q_ is q else o.view(q.shape)), (q_, k_, v_, o, lse, m_, b_), (dims, strides, scale)


class _AttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, bias, inf, full):
        out, saved, geometry = _triton_forward(q, k, v, mask, bias, inf, full)
        ctx.save_for_backward(*saved)
        ctx.meta = (q.shape, k.shape, full, bias.shape if bias is not None else None, *geometry, float(inf))
        ctx.layouts = _layouts(saved)
        return out

    @staticmethod
    def backward(ctx, do):
        saved = ctx.saved_tensors
        q_, k_, v_, o, lse, m_, b_ = saved
        meta = ctx.meta
        if _layouts(saved) != ctx.layouts:
            # A saved-tensor hook gave an operand back in another layout (save_on_cpu does, for an expanded mask):
            # the kernels must read the tensors they get with their own strides, not the forward's.
            q_shape, k_shape, full = meta[0], meta[1], meta[2]
            m_, b_ = (t if t is None or _broadcast_strides(t, full) is not None else t.reshape(full) for t in (m_, b_))
            q_, k_, v_, m_, b_, dims, strides = _operands(q_.reshape(q_shape), k_.reshape(k_shape),
                                                          v_.reshape(k_shape), m_, b_, full)
            o, lse, meta = o.contiguous(), lse.contiguous(), (*meta[:4], dims, strides, *meta[6:])
        return _triton_backward(do, q_, k_, v_, o, lse, m_, b_, b_ is not None and ctx.needs_input_grad[4], *meta)


def _layouts(tensors) -> tuple:
    return tuple(None if t is None else t.stride() for t in tensors)


def _triton_backward(do, q_, k_, v_, o, lse, m_, b_, need_ds, q_shape, k_shape, full, bias_shape, dims, strides,
                     scale, inf) -> tuple:
    """:class:`_AttentionTriton`'s gradients (also the planned path's where it needs the general backward)."""
    # The kernels read do as contiguous rows of D, as they wrote o.
    dq, dk, dv, ds = _kernels().backward(do.contiguous(), q_, k_, v_, m_, b_, o, lse, scale, inf, need_ds, dims,
                                      strides)
    dbias = None
    if need_ds:
        dbias = ds.view(full).sum_to_size(bias_shape).to(b_.dtype)
    if q_.dim() == len(q_shape) and k_.dim() == len(k_shape):  # gradients already in the inputs' shapes
        return dq, dk, dv, None, dbias, None, None
    return dq.view(q_shape), dk.view(k_shape), dv.view(k_shape), None, dbias, None, None


# ------------------------------------------------------------------------------------------- entry
def attention(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None, bias: Tensor | None = None,
              inf: float = 1e9) -> Tensor:
    """Differentiable masked, biased attention (see the module docstring); returns ``[..., H, NQ, D]``."""
    out = _lean(query, key, value, mask, bias, inf)  # the planned eager Triton path (None: the general one)
    return out if out is not None else general(query, key, value, mask, bias, inf)


def general(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, bias: Tensor | None,
            inf: float) -> Tensor:
    """:func:`attention`'s general path (checked and routed), where its planned path (``_lean``) answered None."""
    full = check_args(query, key, value, mask, bias)
    if not isinstance(inf, (int, float)) or not inf > 0:
        raise ValueError(f"inf must be a positive number, got {inf!r}")
    # (check_args passed: query is a tensor and decides, as select(query, key, value) did.) While Dynamo traces,
    # the backend context cannot be read (a ContextVar: a graph break): GPU tensors take the kernels, CPU
    # tensors PyTorch's path, as "auto" chooses.
    compiling = torch.compiler.is_compiling()
    if (query.is_cuda if compiling else _backend.select_tensor(query) == "triton") and query.dtype != torch.float64:
        # Outside torch.func transforms and tracing, the C++ Function.apply without its Python wrapper
        # (which unwraps torch.func's dead wrappers, ~4 µs).
        if compiling or torch._C._are_functorch_transforms_active():
            return _AttentionTriton.apply(query, key, value, mask, bias, float(inf), full)
        if not (torch.is_grad_enabled() and torch._C._any_requires_grad(query, key, value, bias)):
            # Nothing to record: the kernels alone, without the Function's context and saved tensors.
            return _triton_forward(query, key, value, mask, bias, float(inf), full)[0]
        return _triton_apply(query, key, value, mask, bias, float(inf), full)
    return _attention_torch(query, key, value, mask, bias, inf)


_triton_apply = super(torch.autograd.Function, _AttentionTriton).apply


# The planned eager path of the Triton kernels (apex.ops._openfold_attention_direct): the output, or None where
# attention's general path takes the call.
_lean = Lean(check_args, _operands, _triton_backward, _kernels).run
