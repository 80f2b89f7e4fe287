"""Sigmoid focal loss (RetinaNet-style, Apex's ``focal_loss_cuda``): forward computes the loss partial sums
and the un-normalised gradient in the same pass; backward scales that gradient in place.

Per element ``p`` (class ``j`` of a row with target ``y``; ``y = −2`` ignored, ``y = −1`` background,
classes ``j ≥ num_real_classes`` are padding), with ``σ = sigmoid(p)`` and ``sp = softplus(−p) = −log σ``:
negative (``j ≠ y``): ``(1−α)·σ^γ·(n·p + sp)``; positive: ``α·(1−σ)^γ·(q·p + sp)``, where label smoothing
``ε`` gives ``n = 1 − ε/2``, ``q = ε/2`` (``n = 1``, ``q = 0`` without): the BCE against targets
``1 − ε/2`` and ``ε/2``. The gradient is the exact
derivative of that loss. Each program writes one partial loss sum; they are added in a fixed order. A target
outside ``[−2, num_real_classes)`` makes the loss NaN and its row's gradient zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _focal_fwd(x_ptr, y_ptr, grad_ptr, part_ptr, npos_ptr, M, K, K_REAL, alpha, gamma, smoothing,
               ROWS: tl.constexpr, BLOCK_K: tl.constexpr, FINISH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_K)
    rmask = rows < M
    mask = rmask[:, None] & (cols < K)[None, :]
    offs = rows.to(tl.int64)[:, None] * K + cols[None, :]
    p = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + rows, mask=rmask, other=-2)
    sig = tl.sigmoid(p)
    sp = tl.maximum(-p, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(p)))  # softplus(−p) without overflow
    pos = (cols[None, :] == y[:, None]) & (y[:, None] >= 0)
    base_coef = tl.where(pos, smoothing * 0.5, 1.0 - smoothing * 0.5)
    off_b = tl.where(pos, 1.0 - smoothing + smoothing * 0.5, smoothing * 0.5) - sig
    w1 = tl.where(pos, alpha, 1.0 - alpha)
    q = tl.where(pos, 1.0 - sig, sig)
    # q^γ with q in (0, 1]; exp2(γ·log2 q) is 0 at q = 0 (log2 0 = −inf) for γ > 0.
    qg = tl.where(q > 0.0, tl.exp2(gamma * tl.log2(q)), tl.where(gamma == 0.0, 1.0, 0.0))
    coeff_f = w1 * qg
    coeff_b = tl.where(pos, -gamma * sig, gamma * (1.0 - sig))
    bce = base_coef * p + sp
    # A target outside [-2, K_REAL) (not checked on the host): a NaN loss, and no gradient for its row.
    bad = ((y < -2) | (y >= K_REAL))[:, None]
    valid = mask & (y[:, None] != -2) & (cols[None, :] < K_REAL) & ~bad
    loss = tl.where(bad, float("nan"), tl.where(valid, coeff_f * bce, 0.0))
    grad = tl.where(valid, coeff_f * (coeff_b * bce - off_b), 0.0)
    tl.store(grad_ptr + offs, grad.to(grad_ptr.dtype.element_ty), mask=mask)
    part = tl.sum(tl.sum(loss, axis=1), axis=0)
    if FINISH:  # the only program: the loss itself, divided as PyTorch divides (IEEE)
        part = tl.math.div_rn(part, tl.load(npos_ptr).to(tl.float32))
    tl.store(part_ptr + pid, part)


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_focal_fwd)


@triton.jit
def _focal_bwd(grad_ptr, g_ptr, npos_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    scale = tl.load(g_ptr).to(tl.float32) / tl.load(npos_ptr).to(tl.float32)
    gr = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(grad_ptr + offs, (gr * scale).to(grad_ptr.dtype.element_ty), mask=mask)


# Launch plans (rows a program, class block, programs) by (rows, classes): a call of a shape seen before looks
# them up.
_PLANS = _tuning.plan_cache()


def _plan(m: int, k: int) -> tuple[int, int, int]:
    block_k = next_power_of_2(max(k, 1))
    budget = 65536 if _INTERP else 4096
    rows = max(1, min(next_power_of_2(max(m, 1)), budget // block_k))
    return rows, block_k, (cdiv(m, rows) if m else 0)


def forward(x: torch.Tensor, labels: torch.Tensor, num_positives_sum: torch.Tensor, num_real_classes: int,
            alpha: float, gamma: float, smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, partial_grad)`` for a contiguous ``[M, K]`` ``x``; loss is a 0-d fp32 tensor."""
    m, k = x.shape
    grad = torch.empty_like(x)
    plan = _PLANS.get((m, k))
    if plan is None:
        plan = _PLANS[(m, k)] = _plan(m, k)
    rows, block_k, progs = plan
    if progs == 1:  # one program sums and normalises: no reduction or division around the launch
        loss = x.new_empty((), dtype=torch.float32)  # ~2k instructions less than torch.empty(..., device=)
        _focal_fwd[(1,)](x, labels, grad, loss, num_positives_sum, m, k, int(num_real_classes), float(alpha),
                         float(gamma), float(smoothing), rows, block_k, True)  # ROWS, BLOCK_K, FINISH
        return loss, grad
    parts = torch.empty(progs, device=x.device, dtype=torch.float32) if progs else \
        torch.zeros(1, device=x.device, dtype=torch.float32)
    if progs:  # every program writes its partial sum
        _focal_fwd[(progs,)](x, labels, grad, parts, num_positives_sum, m, k, int(num_real_classes), float(alpha),
                             float(gamma), float(smoothing), rows, block_k, False)  # ROWS, BLOCK_K, FINISH
    loss = parts.sum() / num_positives_sum.reshape(()).float()
    return loss, grad


def backward(grad_loss: torch.Tensor, partial_grad: torch.Tensor, num_positives_sum: torch.Tensor) -> torch.Tensor:
    """Scale ``partial_grad`` in place by ``grad_loss / num_positives_sum`` and return it."""
    n = partial_grad.numel()
    if n:
        block = 65536 if _INTERP else 1024
        # (the kernel reads both one-element tensors in their own dtypes and rounds them to fp32)
        _focal_bwd[(cdiv(n, block),)](partial_grad, grad_loss, num_positives_sum, n, block)  # BLOCK
    return partial_grad
