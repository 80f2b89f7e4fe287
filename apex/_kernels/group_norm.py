"""GroupNorm (+ optional SiLU) forward and backward on ``[N, C, S]`` views of NCHW or NHWC tensors.

Addressing is by strides, so NCHW (channel stride S) and NHWC / channels_last (channel stride 1) share the
kernels; a program works on a ``[BLOCK_S, BLOCK_C]`` tile of one (sample, group).

Small groups (the whole group fits one tile): one program per (n, group) reads x once, keeps it in
registers for the statistics and writes y: one launch, minimum traffic. The backward likewise reads x and dy
once and writes dx plus one row of per-channel partial (dgamma, dbeta) sums per sample.

Large groups: each (n, group) is split over ``SPLIT`` programs (enough programs to fill a GPU when N·G is
small). A statistics kernel writes each slice's (count, mean, M2) (Welford/Chan merge across tiles); the
apply kernel merges the ``SPLIT`` partials of its group itself (fixed order: deterministic) and writes y.
The backward does the same with (Σ dŷ, Σ dŷ·x̂). The per-channel parameter gradients are reduced from
per-(n, slice) partial rows by one ``sum`` over rows: no atomics anywhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2


class _Limits(dict):
    """Tile sizes (elements; None: the defaults of ``_new_plan``), lowered by tests to exercise the split path. A
    change empties every launch plan (``_tuning.invalidate``): also those ``apex.ops._group_norm_direct`` keeps."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        _tuning.invalidate()

    def __delitem__(self, key):
        super().__delitem__(key)
        _tuning.invalidate()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        _tuning.invalidate()


LIMITS: dict[str, int | None] = _Limits(tile=None, fuse_max=None)
MAX_GROUP_CHANNELS = 16384


@triton.jit
def _tile(x_ptr, n, g, s0, s_end, sn, sc, ss, CG, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    s = s0 + tl.arange(0, BLOCK_S)
    c = tl.arange(0, BLOCK_C)
    mask = (s < s_end)[:, None] & (c < CG)[None, :]
    offs = n.to(tl.int64) * sn + (g * CG + c)[None, :].to(tl.int64) * sc + s[:, None].to(tl.int64) * ss
    return offs, mask, c


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_tile)


@triton.jit
def _affine_act(xhat, w, b, ACT: tl.constexpr):
    z = xhat * w[None, :] + b[None, :]
    if ACT:
        z = z * tl.sigmoid(z)
    return z


@triton.jit
def _grad_pre_act(dy, xhat, w, b, ACT: tl.constexpr):
    if ACT:  # d silu(z)/dz = σ(z)·(1 + z·(1 − σ(z)))
        z = xhat * w[None, :] + b[None, :]
        sg = tl.sigmoid(z)
        dy = dy * sg * (1.0 + z * (1.0 - sg))
    return dy


@triton.jit
def _params(w_ptr, b_ptr, g, c, CG, HAS_W: tl.constexpr):
    cm = c < CG
    if HAS_W:
        w = tl.load(w_ptr + g * CG + c, mask=cm, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + g * CG + c, mask=cm, other=0.0).to(tl.float32)
    else:
        w = tl.where(cm, 1.0, 0.0)
        b = tl.zeros_like(w)
    return w, b


@triton.jit
def _gn_fwd_fused(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, G, S, CG, sn, sc, ss, eps,
                  HAS_W: tl.constexpr, ACT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    ng = tl.program_id(0)
    n = ng // G
    g = ng % G
    offs, mask, c = _tile(x_ptr, n, g, 0, S, sn, sc, ss, CG, BLOCK_S, BLOCK_C)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    cnt = (S * CG).to(tl.float32)
    mean = tl.sum(tl.sum(x, axis=1), axis=0) / cnt
    d = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(d * d, axis=1), axis=0) / cnt + eps)
    w, b = _params(w_ptr, b_ptr, g, c, CG, HAS_W)
    y = _affine_act(d * rstd, w, b, ACT)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + ng, mean)
    tl.store(rstd_ptr + ng, rstd)


@triton.jit
def _gn_stats(x_ptr, part_ptr, G, S, CG, S_PER, SPLIT, sn, sc, ss,
              BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    ng = tl.program_id(0)
    sp = tl.program_id(1)
    n = ng // G
    g = ng % G
    s_lo = sp * S_PER
    s_end = tl.minimum(S, s_lo + S_PER)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for s0 in range(s_lo, s_end, BLOCK_S):
        offs, mask, c = _tile(x_ptr, n, g, s0, s_end, sn, sc, ss, CG, BLOCK_S, BLOCK_C)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        k = (tl.minimum(s_end - s0, BLOCK_S) * CG).to(tl.float32)
        t_mean = tl.sum(tl.sum(x, axis=1), axis=0) / k
        dt = tl.where(mask, x - t_mean, 0.0)
        t_m2 = tl.sum(tl.sum(dt * dt, axis=1), axis=0)
        tot = count + k
        delta = t_mean - mean
        mean = mean + delta * (k / tot)
        m2 = m2 + t_m2 + delta * delta * (count * k / tot)
        count = tot
    base = part_ptr + (ng * SPLIT + sp) * 3
    tl.store(base, count)
    tl.store(base + 1, mean)
    tl.store(base + 2, m2)


@triton.jit
def _merge_stats(part_ptr, ng, SPLIT, BLOCK_P: tl.constexpr):
    j = tl.arange(0, BLOCK_P)
    pm = j < SPLIT
    base = part_ptr + (ng * SPLIT + j) * 3
    cnt = tl.load(base, mask=pm, other=0.0)
    mu = tl.load(base + 1, mask=pm, other=0.0)
    m2 = tl.load(base + 2, mask=pm, other=0.0)
    total = tl.sum(cnt, axis=0)
    mean = tl.sum(cnt * mu, axis=0) / total
    dm = mu - mean
    return mean, (tl.sum(m2, axis=0) + tl.sum(cnt * dm * dm, axis=0)) / total


@triton.jit
def _gn_apply(x_ptr, y_ptr, w_ptr, b_ptr, part_ptr, mean_ptr, rstd_ptr, G, S, CG, S_PER, SPLIT, sn, sc, ss, eps,
              HAS_W: tl.constexpr, ACT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
              BLOCK_P: tl.constexpr):
    ng = tl.program_id(0)
    sp = tl.program_id(1)
    n = ng // G
    g = ng % G
    mean, var = _merge_stats(part_ptr, ng, SPLIT, BLOCK_P)
    rstd = 1.0 / tl.sqrt(var + eps)
    if sp == 0:
        tl.store(mean_ptr + ng, mean)
        tl.store(rstd_ptr + ng, rstd)
    s_lo = sp * S_PER
    s_end = tl.minimum(S, s_lo + S_PER)
    for s0 in range(s_lo, s_end, BLOCK_S):
        offs, mask, c = _tile(x_ptr, n, g, s0, s_end, sn, sc, ss, CG, BLOCK_S, BLOCK_C)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w, b = _params(w_ptr, b_ptr, g, c, CG, HAS_W)
        y = _affine_act((x - mean) * rstd, w, b, ACT)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gn_bwd_sums(dy_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dx_ptr, gpart_ptr, wpart_ptr, bpart_ptr, G, C, S, CG,
                 S_PER, SPLIT, sn, sc, ss, HAS_W: tl.constexpr, ACT: tl.constexpr, FUSED: tl.constexpr,
                 BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per slice: Σ dŷ and Σ dŷ·x̂ for the group, and per-channel Σ dz·x̂, Σ dz. FUSED: also dx."""
    ng = tl.program_id(0)
    sp = tl.program_id(1)
    n = ng // G
    g = ng % G
    mean = tl.load(mean_ptr + ng)
    rstd = tl.load(rstd_ptr + ng)
    s_lo = sp * S_PER
    s_end = tl.minimum(S, s_lo + S_PER)
    c = tl.arange(0, BLOCK_C)
    w, b = _params(w_ptr, b_ptr, g, c, CG, HAS_W)
    a1 = 0.0
    a2 = 0.0
    dgw = tl.zeros((BLOCK_C,), tl.float32)
    dgb = tl.zeros((BLOCK_C,), tl.float32)
    for s0 in range(s_lo, s_end, BLOCK_S):
        offs, mask, c = _tile(x_ptr, n, g, s0, s_end, sn, sc, ss, CG, BLOCK_S, BLOCK_C)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        dz = _grad_pre_act(dy, xhat, w, b, ACT)
        dxh = dz * w[None, :]
        a1 += tl.sum(tl.sum(dxh, axis=1), axis=0)
        a2 += tl.sum(tl.sum(dxh * xhat, axis=1), axis=0)
        dgw += tl.sum(dz * xhat, axis=0)
        dgb += tl.sum(dz, axis=0)
        if FUSED:  # the whole group was this one tile: finish dx from registers
            cnt = (S * CG).to(tl.float32)
            dx = rstd * (dxh - a1 / cnt - xhat * (a2 / cnt))
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_W:  # one row of C partial sums per (sample, slice) in each buffer; rounded to the buffer's dtype
        row = n * SPLIT + sp
        cm = c < CG
        tl.store(wpart_ptr + row.to(tl.int64) * C + g * CG + c, dgw.to(wpart_ptr.dtype.element_ty), mask=cm)
        tl.store(bpart_ptr + row.to(tl.int64) * C + g * CG + c, dgb.to(bpart_ptr.dtype.element_ty), mask=cm)
    if not FUSED:
        tl.store(gpart_ptr + (ng * SPLIT + sp) * 2, a1)
        tl.store(gpart_ptr + (ng * SPLIT + sp) * 2 + 1, a2)


@triton.jit
def _gn_bwd_dx(dy_ptr, x_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, dx_ptr, gpart_ptr, G, S, CG, S_PER, SPLIT,
               sn, sc, ss, HAS_W: tl.constexpr, ACT: tl.constexpr, BLOCK_S: tl.constexpr,
               BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    ng = tl.program_id(0)
    sp = tl.program_id(1)
    n = ng // G
    g = ng % G
    mean = tl.load(mean_ptr + ng)
    rstd = tl.load(rstd_ptr + ng)
    j = tl.arange(0, BLOCK_P)
    pm = j < SPLIT
    cnt = (S * CG).to(tl.float32)
    m1 = tl.sum(tl.load(gpart_ptr + (ng * SPLIT + j) * 2, mask=pm, other=0.0), axis=0) / cnt
    m2 = tl.sum(tl.load(gpart_ptr + (ng * SPLIT + j) * 2 + 1, mask=pm, other=0.0), axis=0) / cnt
    c = tl.arange(0, BLOCK_C)
    w, b = _params(w_ptr, b_ptr, g, c, CG, HAS_W)
    s_lo = sp * S_PER
    s_end = tl.minimum(S, s_lo + S_PER)
    for s0 in range(s_lo, s_end, BLOCK_S):
        offs, mask, c = _tile(x_ptr, n, g, s0, s_end, sn, sc, ss, CG, BLOCK_S, BLOCK_C)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        dxh = _grad_pre_act(dy, xhat, w, b, ACT) * w[None, :]
        dx = rstd * (dxh - m1 - xhat * m2)
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gn_param_grads(wpart_ptr, bpart_ptr, dw_ptr, db_ptr, ROWS, C, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    """dweight and dbias: the column sums of the per-(sample, slice) partial rows, rounded once to the
    parameters' dtype (one launch for both, instead of two reductions and two casts)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    cm = cols < C
    acc_w = tl.zeros((BLOCK,), tl.float32)
    acc_b = tl.zeros((BLOCK,), tl.float32)
    for r0 in range(0, ROWS, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        m = (r < ROWS)[:, None] & cm[None, :]
        offs = r.to(tl.int64)[:, None] * C + cols[None, :]
        acc_w += tl.sum(tl.load(wpart_ptr + offs, mask=m, other=0.0), axis=0)
        acc_b += tl.sum(tl.load(bpart_ptr + offs, mask=m, other=0.0), axis=0)
    tl.store(dw_ptr + cols, acc_w.to(dw_ptr.dtype.element_ty), mask=cm)
    tl.store(db_ptr + cols, acc_b.to(db_ptr.dtype.element_ty), mask=cm)


# ---------------------------------------------------------------------------------------------- launchers
def supported(channels_per_group: int) -> bool:
    return channels_per_group <= MAX_GROUP_CHANNELS


_PLANS = _tuning.plan_cache()  # (N, G, C/G, S, LIMITS) -> Plan


def _new_plan(n: int, groups: int, cg: int, s: int, tile: int | None, fuse_max: int | None):
    """``(fused, BLOCK_S, BLOCK_C, S_PER, SPLIT)`` for an (N, G, C/G, S) problem."""
    interp = _INTERP
    tile = tile or (65536 if interp else 4096)
    fuse_max = fuse_max or (65536 if interp else 16384)
    block_c = next_power_of_2(cg)
    s_pow = next_power_of_2(max(s, 1))
    if s_pow * block_c <= fuse_max:
        return True, s_pow, block_c, max(s, 1), 1
    block_s = min(s_pow, max(1, tile // block_c))
    target = 3 * n * groups if interp else 1024  # programs wanted; the interpreter pays per program
    split = max(1, min(cdiv(s, block_s), cdiv(target, n * groups)))
    s_per = cdiv(cdiv(s, split), block_s) * block_s
    return False, block_s, block_c, s_per, cdiv(s, s_per)


_F32 = torch.float32


class Plan:
    """The launches of one ``(N, G, C/G, S)`` size with ``N·C·S > 0``: tiles, split, each kernel bound to its grid
    (``kernel[grid]`` builds that closure at every call otherwise). This module's launchers and
    ``apex.ops._group_norm_direct`` (a plan per argument layout) both launch through its methods: the same
    arguments, the same bits. ``sn, sc, ss``: the strides of x's ``[N, C, S]`` view (:func:`view_strides`), which
    ``dy`` shares. Constexprs go by position: a keyword costs a launch ~2,000 instructions to bind."""

    __slots__ = ("groups", "ch", "cg", "s", "ng", "fused", "bs", "bc", "s_per", "split", "bp", "rows", "block_r",
                 "block", "_fwd", "_stats", "_apply", "_sums", "_dx", "_reduce")

    def __init__(self, n: int, groups: int, cg: int, s: int, tile: int | None, fuse_max: int | None):
        self.groups, self.cg, self.s, self.ch, self.ng = groups, cg, s, groups * cg, n * groups
        self.fused, self.bs, self.bc, self.s_per, self.split = _new_plan(n, groups, cg, s, tile, fuse_max)
        self.bp, self.rows = next_power_of_2(self.split), n * self.split
        grid = (self.ng, self.split)
        self._fwd, self._stats, self._apply = _gn_fwd_fused[(self.ng,)], _gn_stats[grid], _gn_apply[grid]
        self._sums, self._dx = _gn_bwd_sums[grid], _gn_bwd_dx[grid]
        # dweight/dbias: a tile of BLOCK_R rows × BLOCK channels a step (4096 elements on a GPU; the interpreter
        # pays per step, not per element).
        cap = 65536 if _INTERP else 4096
        self.block = min(next_power_of_2(self.ch), 4096 if _INTERP else 256)
        self.block_r = max(1, min(next_power_of_2(self.rows), cap // self.block))
        self._reduce = _gn_param_grads[(cdiv(self.ch, self.block),)]

    def forward(self, x, sn: int, sc: int, ss: int, weight, bias, eps: float, silu: bool):
        """``(y, mean, rstd)``: y in x's layout, the statistics ``N·G`` fp32 values."""
        ng = self.ng
        y = torch.empty_like(x)  # in x's layout
        # new_empty with integer sizes: ~1 µs less than torch.empty(..., device=..., dtype=...); without its dtype
        # keyword (~2,000 instructions to parse) from an fp32 tensor: x when it is one, then mean.
        mean = x.new_empty(ng) if x.dtype is _F32 else x.new_empty(ng, dtype=_F32)
        rstd = mean.new_empty(ng)
        has_w = weight is not None
        w = weight if has_w else mean
        b = bias if has_w else mean
        if self.fused:  # constexprs: HAS_W, ACT, BLOCK_S, BLOCK_C
            self._fwd(x, y, w, b, mean, rstd, self.groups, self.s, self.cg, sn, sc, ss, eps, has_w, silu, self.bs,
                      self.bc)
            return y, mean, rstd
        split = self.split
        part = mean.new_empty(ng * split * 3)
        self._stats(x, part, self.groups, self.s, self.cg, self.s_per, split, sn, sc, ss, self.bs, self.bc)
        self._apply(x, y, w, b, part, mean, rstd, self.groups, self.s, self.cg, self.s_per, split, sn, sc, ss, eps,
                    has_w, silu, self.bs, self.bc, self.bp)
        return y, mean, rstd

    def backward(self, dy, x, sn: int, sc: int, ss: int, weight, bias, mean, rstd, silu: bool):
        """``(dx, dweight, dbias)``, the parameter gradients in the parameters' dtype (None without affine)."""
        ch, rows = self.ch, self.rows
        dx = torch.empty_like(x)
        has_w = weight is not None
        # Every (n, group, slice) program writes its channels' row of partial sums (no zero fill) into two
        # buffers; _gn_param_grads sums their columns into the gradients, in the parameters' dtype. One row (one
        # sample, one slice) is the gradient itself: written in that dtype, nothing to sum.
        if not has_w:
            wpart = bpart = mean  # (not written)
        elif rows == 1:
            wpart, bpart = weight.new_empty(ch), bias.new_empty(ch)
        elif mean.dtype is _F32:  # (the forward's statistics are) no dtype keyword: see forward
            wpart, bpart = mean.new_empty(rows, ch), mean.new_empty(rows, ch)
        else:
            wpart, bpart = x.new_empty(rows, ch, dtype=_F32), x.new_empty(rows, ch, dtype=_F32)
        w = weight if has_w else mean
        b = bias if has_w else mean
        fused, split = self.fused, self.split
        gpart = mean if fused else x.new_empty(self.ng * split * 2, dtype=_F32)
        # Constexprs by position: HAS_W, ACT, FUSED, BLOCK_S, BLOCK_C (BLOCK_P).
        self._sums(dy, x, w, b, mean, rstd, dx, gpart, wpart, bpart, self.groups, ch, self.s, self.cg, self.s_per,
                   split, sn, sc, ss, has_w, silu, fused, self.bs, self.bc)
        if not fused:
            self._dx(dy, x, w, b, mean, rstd, dx, gpart, self.groups, self.s, self.cg, self.s_per, split, sn, sc, ss,
                     has_w, silu, self.bs, self.bc, self.bp)
        if not has_w:
            return dx, None, None
        if rows == 1:
            return dx, wpart, bpart
        dw, db = weight.new_empty(ch), bias.new_empty(ch)
        self._reduce(wpart, bpart, dw, db, rows, ch, self.block_r, self.block)  # BLOCK_R, BLOCK by position
        return dx, dw, db


def plan(n: int, groups: int, cg: int, s: int) -> Plan:
    """The :class:`Plan` of an (N, G, C/G, S) problem with ``N·C·S > 0`` (kept per size and :data:`LIMITS`)."""
    tile, fuse_max = LIMITS["tile"], LIMITS["fuse_max"]
    key = (n, groups, cg, s, tile, fuse_max)
    p = _PLANS.get(key)
    if p is None:
        if len(_PLANS) >= 256:  # sizes that keep changing (variable batch or resolution): stay bounded
            _PLANS.clear()
        p = _PLANS[key] = Plan(n, groups, cg, s, tile, fuse_max)
    return p


def view_strides(x: torch.Tensor, ch: int, s: int) -> tuple[int, int, int]:
    """``(sn, sc, ss)``: the strides of the ``[N, C, S]`` view of ``x``, whose spatial dims flatten with one stride.
    A contiguous tensor's follow from its sizes: a dim of size 1 may hold any stride even there (a transpose of
    one, ``as_strided``), which addresses nothing but would otherwise be read as S's stride."""
    if x.is_contiguous():
        return ch * s, s, 1
    st, shape = x.stride(), x.shape
    for d in range(len(st) - 1, 1, -1):  # S's stride: the innermost spatial dim that is no size-1 dim
        if shape[d] != 1:
            return st[0], st[1], st[d]
    return st[0], st[1], 1


def forward(x: torch.Tensor, groups: int, weight, bias, eps: float, silu: bool):
    """``(y, mean, rstd)``; ``x`` is ``[N, C, *spatial]`` whose spatial dims flatten with one stride."""
    n, ch = x.shape[:2]
    numel = x.numel()
    if numel == 0:
        mean = x.new_empty(n * groups, dtype=_F32)
        return torch.empty_like(x), mean, mean.new_empty(n * groups)
    s = numel // (n * ch)  # (x[0, 0].numel() would build a view)
    sn, sc, ss = view_strides(x, ch, s)
    return plan(n, groups, ch // groups, s).forward(x, sn, sc, ss, weight, bias, float(eps), silu)


def backward(dy: torch.Tensor, x: torch.Tensor, groups: int, weight, bias, mean, rstd, silu: bool):
    """``(dx, dweight, dbias)``, the parameter gradients in the parameters' dtype (None without affine);
    ``dy`` has x's strides."""
    n, ch = x.shape[:2]
    numel = x.numel()
    if numel == 0:
        dx = torch.empty_like(x)
        return (dx, None, None) if weight is None else (dx, weight.new_zeros(ch), bias.new_zeros(ch))
    s = numel // (n * ch)
    sn, sc, ss = view_strides(x, ch, s)
    return plan(n, groups, ch // groups, s).backward(dy, x, sn, sc, ss, weight, bias, mean, rstd, silu)
