"""Scale-mask-softmax over the last dim of ``[b, np, sq, sk]`` scores, forward and backward, one launch each.

Forward: ``y = softmax(scale · x)`` over the positions not masked (boolean mask, nonzero = masked, any
broadcast strides; causal: key ``k > q`` masked); a fully masked row gives zeros. Backward:
``dx = scale · y · (dy − Σ dy·y)``. Math in fp32, results in the dtype asked for, outputs contiguous.

Rows of up to ``max_block`` keys are held in one block: the scores are read once and the probabilities
written once. Longer rows run an online max/sum over blocks and then a second sweep that writes the
probabilities (so they are read twice). Masked scores are never loaded; with ``causal`` each row is read up
to its diagonal in whole groups of 8 keys (16-byte loads; the diagonal's DRAM sector), the rest of the upper
triangle never. Several short rows share one program. Rows per program and warps: ``_config``'s formula, or
the configuration ``_tuning`` names (an override, the table measured on this GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted

# Widest row held in registers in one block on a GPU (fp32: 32 values per thread at 16 warps).
MAX_BLOCK = 16384


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@triton.jit
def _row_coords(pid, R, NP, SQ, ROWS: tl.constexpr):
    rows = (pid * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rmask = rows < R
    q = rows % SQ
    bh = rows // SQ
    return rows, rmask, q, bh % NP, bh // NP


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_row_coords)


@triton.jit
def _load_scores(X, M, xrow, mrow, q, rmask, k, SK, scale, sxk, smk, HAS_MASK: tl.constexpr,
                 CAUSAL: tl.constexpr):
    """Scaled scores of one ``[ROWS, BLOCK]`` tile, -inf where masked; ``keep`` marks the live ones."""
    inb = rmask[:, None] & (k < SK)
    keep = inb
    if CAUSAL:
        q = q.to(tl.int32)  # (a query index: 32-bit compares, not 64-bit pairs, against the int32 keys)
        keep = keep & (k <= q[:, None])
    if HAS_MASK:
        mv = tl.load(M + mrow[:, None] + k * smk, mask=keep, other=1)
        keep = keep & (mv == 0)
        x = tl.load(X + xrow[:, None] + k * sxk, mask=keep, other=0.0)
    elif CAUSAL:
        # Read up to the diagonal in whole groups of 8 keys: a per-key bound splits the load into one scalar
        # access per key, while 8-key groups are 16-byte vectors of 16-bit scores (two of fp32). The group
        # that holds the diagonal lies in the diagonal's 32-byte DRAM sector; its keys past the diagonal are
        # read but dropped by ``keep`` below.
        end = tl.multiple_of((q // 8 + 1) * 8, 8)
        x = tl.load(X + xrow[:, None] + k * sxk, mask=inb & (k < end[:, None]), other=0.0)
    else:
        x = tl.load(X + xrow[:, None] + k * sxk, mask=keep, other=0.0)
    x = x.to(tl.float32)
    s = tl.where(keep, x * scale, float("-inf"))
    return s, keep, inb


@triton.jit
def _fwd_kernel(X, M, Y, scale, R, NP, SQ, SK,
                sxb, sxh, sxq, sxk, smb, smh, smq, smk,
                HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                ONE_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    rows, rmask, q, h, b = _row_coords(pid, R, NP, SQ, ROWS)
    xrow = b * sxb + h * sxh + q * sxq
    mrow = b * smb + h * smh + q * smq
    yrow = rows * SK
    cols = tl.arange(0, BLOCK)[None, :]
    if ONE_BLOCK:
        s, keep, inb = _load_scores(X, M, xrow, mrow, q, rmask, cols, SK, scale, sxk, smk, HAS_MASK, CAUSAL)
        mx = tl.max(s, axis=1)
        # A fully masked row has max -inf: subtract 0 instead, so every exp is exp(-inf) = 0, never NaN.
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        # Masked scores are -inf and mx is finite or +inf (tl.max skips NaN): their exp is exactly 0.
        e = tl.exp(s - mx[:, None])
        den = tl.sum(e, axis=1)
        inv = tl.where(den > 0.0, 1.0 / tl.where(den > 0.0, den, 1.0), 0.0)
        y = e * inv[:, None]
        tl.store(Y + yrow[:, None] + cols, y.to(Y.dtype.element_ty), mask=inb)
    else:
        m_i = tl.full((ROWS,), float("-inf"), tl.float32)
        l_i = tl.zeros((ROWS,), tl.float32)
        hi = SK
        if CAUSAL:  # keys past the last query of the tile are all masked
            hi = tl.minimum(SK, tl.max(tl.where(rmask, q, 0)) + 1)
        for start in range(0, hi, BLOCK):
            s, keep, inb = _load_scores(X, M, xrow, mrow, q, rmask, start + cols, SK, scale, sxk, smk,
                                        HAS_MASK, CAUSAL)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.where(keep, tl.exp(s - m_safe[:, None]), 0.0), axis=1)
            m_i = m_new
        m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
        inv = tl.where(l_i > 0.0, 1.0 / tl.where(l_i > 0.0, l_i, 1.0), 0.0)
        for start in range(0, SK, BLOCK):
            k = start + cols
            s, keep, inb = _load_scores(X, M, xrow, mrow, q, rmask, k, SK, scale, sxk, smk, HAS_MASK, CAUSAL)
            y = tl.where(keep, tl.exp(s - m_safe[:, None]) * inv[:, None], 0.0)
            tl.store(Y + yrow[:, None] + k, y.to(Y.dtype.element_ty), mask=inb)


@triton.jit
def _bwd_kernel(DY, Y, DX, scale, R, NP, SQ, SK,
                sdb, sdh, sdq, sdk, syb, syh, syq, syk,
                CAUSAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    rows, rmask, q, h, b = _row_coords(pid, R, NP, SQ, ROWS)
    drow = b * sdb + h * sdh + q * sdq
    yrow = b * syb + h * syh + q * syq
    xrow = rows * SK
    cols = tl.arange(0, BLOCK)[None, :]
    if ONE_BLOCK:
        inb = rmask[:, None] & (cols < SK)
        if CAUSAL:  # y is zero above the diagonal: nothing to read there
            # Whole 8-key groups up to the diagonal, as the forward reads (16-byte vectors); the keys past
            # the diagonal that they hold are zeroed, as the unread ones are.
            q = q.to(tl.int32)
            live = inb & (cols <= q[:, None])
            rd = inb & (cols < tl.multiple_of((q // 8 + 1) * 8, 8)[:, None])
            dy = tl.where(live, tl.load(DY + drow[:, None] + cols * sdk, mask=rd, other=0.0).to(tl.float32), 0.0)
            y = tl.where(live, tl.load(Y + yrow[:, None] + cols * syk, mask=rd, other=0.0).to(tl.float32), 0.0)
        else:
            dy = tl.load(DY + drow[:, None] + cols * sdk, mask=inb, other=0.0).to(tl.float32)
            y = tl.load(Y + yrow[:, None] + cols * syk, mask=inb, other=0.0).to(tl.float32)
        dot = tl.sum(dy * y, axis=1)
        dx = scale * y * (dy - dot[:, None])
        tl.store(DX + xrow[:, None] + cols, dx.to(DX.dtype.element_ty), mask=inb)
    else:
        hi = SK
        if CAUSAL:
            hi = tl.minimum(SK, tl.max(tl.where(rmask, q, 0)) + 1)
        dot = tl.zeros((ROWS,), tl.float32)
        for start in range(0, hi, BLOCK):
            k = start + cols
            live = rmask[:, None] & (k < SK)
            if CAUSAL:
                live = live & (k <= q[:, None])
            dy = tl.load(DY + drow[:, None] + k * sdk, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + yrow[:, None] + k * syk, mask=live, other=0.0).to(tl.float32)
            dot += tl.sum(dy * y, axis=1)
        for start in range(0, SK, BLOCK):
            k = start + cols
            inb = rmask[:, None] & (k < SK)
            live = inb
            if CAUSAL:
                live = live & (k <= q[:, None])
            dy = tl.load(DY + drow[:, None] + k * sdk, mask=live, other=0.0).to(tl.float32)
            y = tl.load(Y + yrow[:, None] + k * syk, mask=live, other=0.0).to(tl.float32)
            dx = scale * y * (dy - dot[:, None])
            tl.store(DX + xrow[:, None] + k, dx.to(DX.dtype.element_ty), mask=inb)


def _config(n_rows: int, sk: int, max_block: int | None) -> tuple[int, int, bool, int]:
    """``(ROWS, BLOCK, ONE_BLOCK, num_warps)`` for ``n_rows`` rows of ``sk`` keys."""
    interp = _INTERP
    cap = max_block if max_block is not None else MAX_BLOCK
    block = min(_next_pow2(max(sk, 1)), _next_pow2(cap))
    one = sk <= block
    if interp:
        # The interpreter pays per op of each program, hardly per element: a few programs of up to 2^16
        # elements each.
        rows = max(1, min(_next_pow2(-(-n_rows // 8)), (1 << 16) // block))
    else:
        rows = max(1, min(4096 // block, _next_pow2(n_rows)))
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    return rows, block, one, num_warps


# (rows, keys, max_block, dtype, causal, device index: another GPU may have other entries) -> the launch's
# (ROWS, BLOCK, ONE_BLOCK, warps, launcher), forward and backward apart (each phase has its own measured
# configuration), asked at every launch (emptied with the other plan caches).
_FWD_PLANS = _tuning.plan_cache()
_BWD_PLANS = _tuning.plan_cache()
FWD_OP, BWD_OP = "scaled_softmax.fwd", "scaled_softmax.bwd"


def _plan(t: torch.Tensor, key: tuple, backward: bool) -> tuple:
    """The launch of ``key = (n_rows, sk, max_block, t.dtype, causal, device index)`` (``t``: the scores or
    the gradient): ``_config``'s rows per program and warps unless ``_tuning`` names others (an override, or
    the table measured on this GPU, keyed by ``(n_rows, sk, causal)``: the causal kernel reads half of what
    the others do)."""
    n_rows, sk, max_block, _, causal, _ = key
    rows, block, one, warps = _config(n_rows, sk, max_block)
    op = BWD_OP if backward else FWD_OP
    cfg = _tuning.pick(op, t.device, t.element_size(), (n_rows, sk, int(causal)), {"rows": rows, "warps": warps})
    rows = cfg["rows"]
    # kernel[grid] builds its launcher anew at every call: the grid's kept with the plan.
    grid = (cdiv(n_rows, rows),)
    plan = (rows, block, one, cfg["warps"], (_bwd_kernel if backward else _fwd_kernel)[grid])
    (_BWD_PLANS if backward else _FWD_PLANS)[key] = plan
    return plan


def _mask_strides(mask: torch.Tensor, shape: torch.Size) -> tuple[int, int, int, int]:
    """The strides that read ``mask`` (at most 4-D, broadcasting to ``shape``) at each of ``shape``'s
    positions: 0 along its missing and size-1 dimensions (what ``expand`` gives, without making the view).
    Kept per (mask shape, mask strides, shape): a model passes the same mask layout at every layer and step."""
    msh, mst = mask.shape, mask.stride()
    key = (msh, mst, shape)
    got = _MASK_STRIDES.get(key)
    if got is not None:
        return got
    lead = 4 - len(msh)
    out = [0, 0, 0, 0]
    for i in range(len(msh)):
        if msh[i] != 1 or shape[lead + i] == 1:
            if msh[i] != shape[lead + i]:  # (expand's error: a 3-D input's mask, say, against its 4-D view)
                raise RuntimeError(f"mask of shape {list(msh)} does not broadcast to scores of shape {list(shape)}")
            out[lead + i] = mst[i]
    if len(_MASK_STRIDES) >= 64:
        _MASK_STRIDES.clear()
    got = _MASK_STRIDES[key] = (out[0], out[1], out[2], out[3])
    return got


_MASK_STRIDES: dict = {}  # (mask shape, mask strides, scores shape) -> _mask_strides' answer (pure: never stale)


def forward_launch(x: torch.Tensor, mask: torch.Tensor | None, causal: bool, max_block: int | None) -> tuple:
    """``(launch, tail, warps)`` of the forward on the non-empty 4-D scores ``x``: the launch is
    ``launch(x, mask or x, y, scale, *tail, num_warps=warps)``, ``tail`` every argument after the scale (sizes,
    strides, constexprs), a function of ``x``'s shape, strides, dtype and device, ``mask``'s shape and strides
    (or None), ``causal`` (a bool) and ``max_block``: :func:`forward` launches it, and
    ``apex.ops._softmax_direct`` keeps it per layout."""
    b, h, sq, sk = x.shape
    n_rows = b * h * sq
    key = (n_rows, sk, max_block, x.dtype, causal, x.get_device())
    plan = _FWD_PLANS.get(key)
    # (A hit leaves _tuning.last as the miss recorded it: the sweep times each configuration from its first
    # launch, a miss.)
    rows, block, one, warps, launch = plan if plan is not None else _plan(x, key, False)
    # A bool mask is read as it is: Triton loads a bool pointer's bytes and compares them with zero (no uint8
    # view, an operator call at every forward).
    ms = _mask_strides(mask, x.shape) if mask is not None else (0, 0, 0, 0)  # (no mask: never read)
    # The constexprs positionally (HAS_MASK, CAUSAL, ROWS, BLOCK, ONE_BLOCK): a keyword costs the launch a
    # dictionary entry to build and bind.
    return launch, (n_rows, h, sq, sk, *x.stride(), *ms, mask is not None, causal, rows, block, one), warps


def forward(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool,
            max_block: int | None = None) -> torch.Tensor:
    """Probabilities of the 4-D scores ``x`` (any strides); ``mask`` broadcasts to ``x``'s shape (at most
    4-D; read through zero strides along its broadcast dimensions)."""
    b, h, sq, sk = x.shape
    # Integer sizes (a tuple costs ~1 µs more to parse); new_empty takes x's dtype and device (no arguments to
    # parse for them).
    y = x.new_empty(b, h, sq, sk)
    if b * h * sq * sk == 0:
        return y
    launch, tail, warps = forward_launch(x, mask, bool(causal), max_block)
    launch(x, mask if mask is not None else x, y, float(scale), *tail, num_warps=warps)
    return y


def backward_plan(key: tuple, y: torch.Tensor) -> tuple:
    """The backward's ``(ROWS, BLOCK, ONE_BLOCK, warps, launch)`` of ``key = (n_rows, sk, max_block, y.dtype,
    causal, y.get_device())``."""
    plan = _BWD_PLANS.get(key)
    return plan if plan is not None else _plan(y, key, True)


def backward_tail(plan: tuple, sizes: tuple, sd: tuple, sy: tuple, causal: bool) -> tuple:
    """The backward launch's arguments after the scale: ``launch(dy, y, dx, scale, *tail, num_warps=plan[3])``
    for ``sizes = (n_rows, h, sq, sk)`` and the 4-D strides of ``dy`` and ``y``."""
    return (*sizes, *sd, *sy, causal, plan[0], plan[1], plan[2])  # CAUSAL, ROWS, BLOCK, ONE_BLOCK


def backward(dy: torch.Tensor, y: torch.Tensor, scale: float, causal: bool, out_dtype: torch.dtype,
             max_block: int | None = None) -> torch.Tensor:
    """``scale · y · (dy − Σ dy·y)`` of 4-D ``dy`` and ``y`` (any strides), contiguous in ``out_dtype``."""
    b, h, sq, sk = y.shape
    dx = y.new_empty(b, h, sq, sk) if out_dtype is y.dtype else y.new_empty(b, h, sq, sk, dtype=out_dtype)
    n_rows = b * h * sq
    if n_rows * sk == 0:
        return dx
    causal = bool(causal)
    plan = backward_plan((n_rows, sk, max_block, y.dtype, causal, y.get_device()), y)
    plan[4](dy, y, dx, float(scale), *backward_tail(plan, (n_rows, h, sq, sk), dy.stride(), y.stride(), causal),
            num_warps=plan[3])
    return dx
