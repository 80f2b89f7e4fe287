"""Softmax cross entropy with label smoothing: one-pass forward (online log-sum-exp) and one-pass backward.

Forward, per row of ``V`` logits: the running maximum ``m`` and ``s = Σ exp(x − m)`` are updated chunk by
chunk (the rescaling ``s·exp(m_old − m_new)`` keeps it exact), together with ``Σ x`` and the label's logit,
so the logits are read once. Backward, per element: ``g · (exp(x − lse) − (1−ε)·[j = label] − ε/V)``, read
once and written once; the gradient may be written over the logits themselves (``out`` aliasing ``x``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


@triton.jit
def _xent_fwd(x_ptr, lab_ptr, loss_ptr, lse_ptr, M, V, stride_x, smoothing, padding_idx,
              ROWS: tl.constexpr, BLOCK: tl.constexpr, STAGES: tl.constexpr, SMOOTH: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    label = tl.load(lab_ptr + rows, mask=rmask, other=0)
    base = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    # The label's logit: one load per row (a compare and a sum over every chunk otherwise).
    valid = rmask & (label >= 0) & (label < V)
    x_lab = tl.load(x_ptr + rows.to(tl.int64) * stride_x + label, mask=valid, other=0.0).to(tl.float32)
    m = tl.full((ROWS,), -3.0e38, tl.float32)  # finite: exp(m_old − m_new) never sees −inf − (−inf)
    # Σ exp(x − m) and Σ x are kept per lane and summed across the block once, after the loop: a chunk then
    # pays one block-wide reduction (its maximum) instead of three, each with its shuffles and barriers.
    s = tl.zeros((ROWS, BLOCK), tl.float32)
    sum_x = tl.zeros((ROWS, BLOCK), tl.float32)
    # STAGES > 1: the next chunks' loads are issued (cp.async) while this one is reduced.
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < V)[None, :]
        x = tl.load(base + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new)[:, None] + tl.exp(x - m_new[:, None])
        m = m_new
        if SMOOTH:  # Σ x only feeds the smoothing term
            sum_x += tl.where(mask, x, 0.0)
    lse = m + tl.log(tl.sum(s, axis=1))
    loss = lse - (1.0 - smoothing) * x_lab
    if SMOOTH:
        loss -= smoothing * (tl.sum(sum_x, axis=1) / V)
    # A label outside [0, V) (and not padding_idx) gives a NaN loss: checked here, not by a host read.
    loss = tl.where((label < 0) | (label >= V), float("nan"), loss)
    loss = tl.where(label == padding_idx, 0.0, loss)
    tl.store(loss_ptr + rows, loss, mask=rmask)
    tl.store(lse_ptr + rows, lse, mask=rmask)


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_xent_fwd)


@triton.jit
def _xent_bwd(g_ptr, x_ptr, lab_ptr, lse_ptr, out_ptr, M, V, stride_x, stride_o, stride_g, smoothing,
              padding_idx, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    rmask = rows < M
    mask = rmask[:, None] & (cols < V)[None, :]
    label = tl.load(lab_ptr + rows, mask=rmask, other=0)
    g = tl.load(g_ptr + rows * stride_g, mask=rmask, other=0.0).to(tl.float32)
    # Padding rows and rows whose label lies outside [0, V) (a NaN loss) give a zero gradient.
    g = tl.where((label == padding_idx) | (label < 0) | (label >= V), 0.0, g)
    lse = tl.load(lse_ptr + rows, mask=rmask, other=0.0)
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    p = tl.exp(x - lse[:, None])
    # g·(p − ε/V − (1−ε)·[j = label]) as g·p − c, c one of the row's two constants (formed once): per element
    # a select and a fused multiply-add. The label is compared as int32 (a 64-bit compare of every column
    # costs three instructions); a label outside int32 lies outside [0, V), whose row has g = 0 above.
    g_uniform = g * (smoothing / V)
    g_at_label = g_uniform + g * (1.0 - smoothing)
    c = tl.where(cols[None, :] == label.to(tl.int32)[:, None], g_at_label[:, None], g_uniform[:, None])
    dx = g[:, None] * p - c
    tl.store(out_ptr + r64 * stride_o + cols[None, :], dx.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_per_program(m: int, v: int, block: int) -> int:
    # Short vocabularies: several rows per program keep the grid (and the interpreter's time) small.
    rows = max(1, min(64, 4096 // max(block, 1)))
    if _INTERP:
        rows = max(rows, min(64, next_power_of_2(max(1, m // 8))))
    return min(next_power_of_2(max(m, 1)), rows)


def _block(v: int) -> int:
    cap = 8192 if _INTERP else 4096
    return min(cap, next_power_of_2(max(v, 16)))


# (x's shape [rows, V], dtype, device index, backward) -> the launch's (launcher, rows, block, warps, stages, the
# picked configuration, M, V), or None for an empty x: keyed by the torch.Size itself (no unpacking, no
# element_size query a call).
_PLANS = _tuning.plan_cache()


def _plan(x: torch.Tensor, backward: bool) -> tuple | None:
    key = (x.shape, x.dtype, x.get_device(), backward)
    p = _PLANS.get(key)
    op = "xentropy.bwd" if backward else "xentropy.fwd"
    if p is None:
        if key in _PLANS:  # an empty x: nothing to launch
            return None
        m, v = key[0]
        if m == 0 or v == 0:
            _PLANS[key] = None
            return None
        if backward:
            # One row of 4096 columns a program on a GPU: 14.8 SASS instructions an element on sm_90 against
            # 17 for 4 rows x 1024 (the per-row constants and addresses are formed once per program).
            block = _block(v)
            cfg = _tuning.pick(op, x.device, x.element_size(), (m, v),
                               {"rows": _rows_per_program(m, v, block), "block": block, "warps": 4})
            grid = (cdiv(m, cfg["rows"]), cdiv(v, cfg["block"]))
        else:
            block = _block(v)
            cfg = _tuning.pick(op, x.device, x.element_size(), (m, v), {"rows": _rows_per_program(m, v, block),
                                                                "block": block, "warps": 4, "stages": 1})
            grid = (cdiv(m, cfg["rows"]),)
        # The grid's launcher kept with it: kernel[grid] builds a new one at every call.
        launcher = (_xent_bwd if backward else _xent_fwd)[grid]
        p = _PLANS[key] = (launcher, cfg["rows"], cfg["block"], cfg["warps"], cfg.get("stages", 1), cfg, m, v)
    else:
        _tuning.last[op] = p[5]  # as pick records it
    return p


def forward(x: torch.Tensor, labels: torch.Tensor, smoothing: float, padding_idx: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses, lse)`` in fp32 for a ``[M, V]`` view with unit column stride. A row whose label lies
    outside ``[0, V)`` and is not ``padding_idx`` gets a NaN loss (no host-side check)."""
    p = _plan(x, False)
    if p is None:
        m = x.shape[0]
        return x.new_empty(m, dtype=torch.float32), x.new_empty(m, dtype=torch.float32)
    launch, rows, block, warps, stages, _, m, v = p
    # new_empty: the device from x, no device argument to parse (~0.3 µs each).
    losses = x.new_empty(m, dtype=torch.float32)
    lse = x.new_empty(m, dtype=torch.float32)
    # The constexprs positionally (ROWS, BLOCK, STAGES, SMOOTH): each keyword costs a launch ~2,000
    # instructions of dictionary building and binding.
    # (stride()[0], not stride(0): the latter parses its int-or-name overloads on every call)
    launch(x, labels, losses, lse, m, v, x.stride()[0], float(smoothing), int(padding_idx), rows, block, stages,
           smoothing != 0.0, num_warps=warps)
    return losses, lse


def backward(grad: torch.Tensor, x: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, smoothing: float,
             padding_idx: int, out: torch.Tensor) -> torch.Tensor:
    """Write the logits' gradient into ``out`` (which may be ``x`` itself) and return it; rows whose label is
    padding or outside ``[0, V)`` get zeros."""
    p = _plan(x, True)
    if p is None:
        return out
    launch, rows, block, warps, _, _, m, v = p
    launch(grad, x, labels, lse, out, m, v, x.stride()[0], out.stride()[0], grad.stride()[0], float(smoothing),
           int(padding_idx), rows, block, num_warps=warps)  # ROWS, BLOCK
    return out
