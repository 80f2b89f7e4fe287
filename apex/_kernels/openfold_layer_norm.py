"""LayerNorm for OpenFold's small rows (N of 64–256 over millions of rows): kernels and launchers.

A program normalises ``ROWS`` whole rows at once (one ``[ROWS, BLOCK_N]`` tile), so short rows still fill a
block. Inputs may be a 4-D strided view normalised over its last dimension (OpenFold's transposed pair
activations): row ``m`` of ``[D0, D1, D2, N]`` starts at ``i0·S0 + i1·S1 + i2·S2`` and its elements are
``SN`` apart, so no copy is made. Outputs are contiguous. Statistics are fp32.

Backward: one kernel writes ``dx`` and, per program, fp32 partial sums of ``dy·x̂`` and ``dy`` over the
rows it owns (a fixed number of programs, each walking a contiguous range of rows); a second kernel sums
the partial rows in a fixed order into ``dweight``/``dbias``. No atomics: results are deterministic.

``ROWS`` is autotuned on GPUs (``triton.autotune``, key ``(M, N)``); under the Triton interpreter the
autotuners hold a single fixed config, since the interpreter cannot benchmark.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2

MAX_N = 16384  # longer rows do not fit one tile; the op layer sends them to PyTorch


def _configs() -> list:
    if _INTERP:
        return [triton.Config({"ROWS": 16}, num_warps=1)]
    return [triton.Config({"ROWS": r}, num_warps=w) for r in (1, 2, 4, 8, 16, 32) for w in (1, 2, 4, 8)]


def _prune(configs, named_args, **kwargs):
    # Tiles above 16K fp32 values spill registers; keep at least one config whatever N is.
    block_n = kwargs.get("BLOCK_N", named_args.get("BLOCK_N", 1))
    kept = [c for c in configs if c.kwargs["ROWS"] * block_n <= 16384]
    return kept or configs[:1]


@triton.jit
def _row_start(rows, D1, D2, S0, S1, S2):
    r = rows.to(tl.int64)
    i0 = r // (D1 * D2)
    rest = r % (D1 * D2)
    return i0 * S0 + (rest // D2) * S1 + (rest % D2) * S2


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_row_start)


@triton.autotune(configs=_configs(), key=["M", "N"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _ln_fwd(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, M, N, D1, D2, S0, S1, S2, SN, eps,
            HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)  # 64-bit offsets: no overflow, no overflow checks
    rmask = rows < M
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    start = _row_start(rows, D1, D2, S0, S1, S2)
    x = tl.load(x_ptr + start[:, None] + cols[None, :] * SN, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / N
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
    y = xc * rstd[:, None]
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    out = rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + rows, mean, mask=rmask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.autotune(configs=_configs(), key=["M", "N"], prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _ln_bwd(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, M, N, rows_per_prog,
            D1, D2, S0, S1, S2, SN, HAS_W: tl.constexpr, NEED_DW: tl.constexpr, NEED_DB: tl.constexpr,
            BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    # part_ptr: one row per program holding its dweight partial sums (NEED_DW), then its dbias ones (NEED_DB)
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N).to(tl.int64)  # 64-bit offsets: no overflow, no overflow checks
    cmask = cols < N
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_prog
    last = tl.minimum(first + rows_per_prog, M)
    for r0 in range(first, last, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        rmask = rows < last
        mask = rmask[:, None] & cmask[None, :]
        start = _row_start(rows, D1, D2, S0, S1, S2)
        x = tl.load(x_ptr + start[:, None] + cols[None, :] * SN, mask=mask, other=0.0).to(tl.float32)
        out = rows.to(tl.int64)[:, None] * N + cols[None, :]
        dy = tl.load(dy_ptr + out, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + rows, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_W:
            g = dy * w[None, :]
        else:
            g = dy
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        dx = (g - c2[:, None] - xhat * c1[:, None]) * rstd[:, None]
        tl.store(dx_ptr + out, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if NEED_DW:
            dw_acc += tl.sum(dy * xhat, axis=0)
        if NEED_DB:
            db_acc += tl.sum(dy, axis=0)
    row = part_ptr + pid * (N * (NEED_DW + NEED_DB))
    if NEED_DW:
        tl.store(row + cols, dw_acc, mask=cmask)
    if NEED_DB:
        tl.store(row + N * NEED_DW + cols, db_acc, mask=cmask)


@triton.jit
def _column_sum(part_ptr, out0_ptr, out1_ptr, P, N, PS, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """Column sums of the P rows (row stride PS) of partial sums: program_id(1) 0 sums the first N columns
    into out0, 1 the next N into out1 (dweight and dbias in one launch)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    which = tl.program_id(1)
    cmask = cols < N
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    base = part_ptr + which * N
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        m = (ps < P)[:, None] & cmask[None, :]
        acc += tl.sum(tl.load(base + ps[:, None] * PS + cols[None, :], mask=m, other=0.0), axis=0)
    if which == 0:
        tl.store(out0_ptr + cols, acc.to(out0_ptr.dtype.element_ty), mask=cmask)
    else:
        tl.store(out1_ptr + cols, acc.to(out1_ptr.dtype.element_ty), mask=cmask)


def tuneable_kernels() -> dict:
    """The autotuned kernels by name (their ``.cache`` maps a tuning key to the chosen config)."""
    return {"_ln_fwd": _ln_fwd, "_ln_bwd": _ln_bwd}


def _geometry(x: torch.Tensor) -> tuple[int, int, int, int, int, int, int, int]:
    """``(M, N, D1, D2, S0, S1, S2, SN)`` for a tensor of up to 4 dims normalised over its last dim."""
    if x.dim() == 2:  # the usual rows: no lists built
        m, n = x.shape
        s_m, sn = x.stride()
        return m, n, 1, m, 0, 0, s_m, sn
    *lead, n = x.shape
    lead = [1] * (3 - len(lead)) + list(lead)
    strides = [0] * (3 - (x.dim() - 1)) + list(x.stride()[:-1])
    m = lead[0] * lead[1] * lead[2]
    return m, n, lead[1], lead[2], strides[0], strides[1], strides[2], x.stride(-1)


def _programs(m: int, device: torch.device) -> int:
    if device.type == "cuda":
        cap = 2 * _tuning.device(device)[1]  # the SM count, asked once per device
    else:
        cap = 4  # the interpreter runs programs one by one: few, long programs
    return max(1, min(m, cap))


# What a warm launch of a shape seen before needs, by (direction, sizes, flags, dtypes[, device]): the
# autotuner's key and the config it chose for it, the grid's launcher, the constexprs and the launch options.
# Emptied with the other launchers' plans (apex._kernels._tuning.invalidate).
_PLANS = _tuning.plan_cache()


def _autotuner_key(kernel, args: tuple) -> tuple | None:
    """The key ``triton.autotune`` files this launch's config under (its ``key`` arguments, then the dtype of
    every tensor argument, as its ``run`` builds it); None for a single-config autotuner, which keeps no
    cache and always runs that config."""
    if len(kernel.configs) == 1:
        return None
    named = dict(zip(kernel.arg_names, args))
    return (*(named[k] for k in kernel.keys), *(str(a.dtype) for a in args if hasattr(a, "dtype")))


def _launch_kept(kernel, plan: tuple, args: tuple) -> bool:
    """A warm launch from its kept plan (see :func:`_launch`), False where the autotuner's cache no longer holds
    that plan's config for its key. The constexprs go by position after ``args`` (a keyword costs a launch
    ~2,000 instructions of dictionary building and binding); the launch options (warps, stages) by keyword."""
    tkey, config, launcher, tail, options = plan
    if (kernel.configs[0] if tkey is None else kernel.cache.get(tkey)) is not config:
        return False
    if options:
        launcher(*args, *tail, **options)
    else:
        launcher(*args, *tail)
    return True


def _launch_options(options: dict) -> dict:
    """The config's launch options that differ from Triton's defaults (4 warps, 1 CTA, the backend's stages):
    each keyword costs a launch ~2,000 instructions; the interpreter takes none."""
    if _INTERP:
        return {}
    defaults = {"num_warps": 4, "num_ctas": 1, "num_stages": _default_stages()}
    return {k: v for k, v in options.items() if k not in defaults or defaults[k] != v}


def _default_stages() -> int:
    # Triton's HIPOptions / CUDAOptions defaults (a target query: once per plan)
    return 2 if triton.runtime.driver.active.get_current_target().backend == "hip" else 3


def _launch(kernel, plan_key: tuple, grid, args: tuple, constexprs: dict) -> None:
    """``kernel[grid](*args, **constexprs)`` for an autotuned ``kernel``; ``grid`` is a tuple or, for a grid that
    depends on the config, a function of its keyword arguments. A shape launched before takes the plan kept
    then: the config the autotuner chose, launched directly (no key building, cache lookup and argument
    merging per call), as long as the autotuner's cache still holds that very config for the key, so a cache
    replaced or edited (``_load_triton_auto_tune_cache``, sync across ranks, an assignment) is followed."""
    plan = _PLANS.get(plan_key)
    if plan is not None and _launch_kept(kernel, plan, args):
        return
    kernel[grid](*args, **constexprs)
    config = getattr(kernel, "best_config", None)  # (unset where the launch was intercepted: compile checks)
    tkey = _autotuner_key(kernel, args)
    if config is None or config.pre_hook is not None or \
            (kernel.configs[0] if tkey is None else kernel.cache.get(tkey)) is not config:
        return  # a hook to run per launch, or a key built otherwise by this Triton: the autotuner each call
    options = {**constexprs, **config.all_kwargs()}
    launch_grid = grid if isinstance(grid, tuple) else grid(options)
    names = kernel.arg_names[len(args):]  # the constexprs, in the kernel's order
    if not all(name in options for name in names):
        return
    tail = tuple(options.pop(name) for name in names)
    # The grid's launcher kept (kernel.fn[grid] builds one at every call).
    _PLANS[plan_key] = (tkey, config, kernel.fn[launch_grid], tail, _launch_options(options))


_F32 = torch.float32


def _contiguous_like(x: torch.Tensor) -> torch.Tensor:
    """``torch.empty_like(x, memory_format=torch.contiguous_format)``, without the keyword for a contiguous ``x``
    (whose layout empty_like keeps)."""
    return torch.empty_like(x) if x.is_contiguous() else torch.empty_like(x, memory_format=torch.contiguous_format)


def forward(x: torch.Tensor, weight, bias, eps: float):
    """``(y, mean, rstd)`` for ``x`` of at most 4 dims normalised over its last dim; ``y`` contiguous."""
    geo = _geometry(x)
    m = geo[0]
    # (empty_like takes ~2 µs less than a torch.Size argument; contiguous: the kernels write rows in order.
    # Without keywords where the default is the answer: each costs an allocation ~2,000 instructions to parse.)
    y = _contiguous_like(x)
    mean = x.new_empty(m) if x.dtype is _F32 else torch.empty(m, dtype=_F32, device=x.device)
    rstd = mean.new_empty(m)
    if m == 0:
        return y, mean, rstd
    w, b = weight if weight is not None else x, bias if bias is not None else x
    key = (False, m, geo[1], weight is not None, bias is not None, x.dtype, w.dtype, b.dtype)
    (_FWD.get(key) or fwd_plan(key)).launch((x, w, b, y, mean, rstd, *geo, float(eps)))
    return y, mean, rstd


# The launches, written once as plan methods: this module's launchers and apex.ops._openfold_ln_direct (which keeps
# an argument layout's geometry and these plans) both launch through them, with the same arguments: the same bits
# and the same configuration (the kept launch while the autotuner's cache holds its config, else the autotuner).
# Plans live in _tuning's plan caches (emptied with the other launchers' plans by _tuning.invalidate).
_FWD = _tuning.plan_cache()
_BWD = _tuning.plan_cache()


class _FwdPlan:
    """The forward launch of one key ``(False, M, N, has weight, has bias, x, weight, bias dtypes)`` (an absent
    parameter's dtype is x's): its constexprs and the launch kept after the autotuner's (``_launch``)."""

    __slots__ = ("key", "m", "constexprs", "kept")

    def __init__(self, key: tuple):
        self.key, self.m, self.kept = key, key[1], None
        self.constexprs = {"HAS_W": key[3], "HAS_B": key[4], "BLOCK_N": next_power_of_2(key[2])}

    def launch(self, args: tuple) -> None:
        """``args``: ``(x, weight or x, bias or x, y, mean, rstd, *geometry, eps)``."""
        kept = self.kept
        if kept is not None:  # (_launch_kept, inline: a frame less)
            tkey, config, launcher, tail, options = kept
            if (_ln_fwd.configs[0] if tkey is None else _ln_fwd.cache.get(tkey)) is config:
                if options:
                    launcher(*args, *tail, **options)
                else:
                    launcher(*args, *tail)
                return
        m = self.m
        _launch(_ln_fwd, self.key, lambda meta: (cdiv(m, meta["ROWS"]),), args, self.constexprs)
        self.kept = _PLANS.get(self.key)


def fwd_plan(key: tuple) -> _FwdPlan:
    """The forward plan of ``key`` (made and kept where new)."""
    p = _FWD.get(key)
    if p is None:
        p = _FWD[key] = _FwdPlan(key)
    return p


class _BwdPlan:
    """The backward launches of one key ``(True, M, N, has weight, need dw, need db, dy, x, weight (or x), mean,
    rstd dtypes, device type, device index)``: programs, rows each, the column sums' launcher, the constexprs and
    the rows' launch kept after the autotuner's."""

    __slots__ = ("key", "m", "n", "need_dw", "need_db", "progs", "per_prog", "column_sum", "k", "block_c",
                 "constexprs", "kept")

    def __init__(self, key: tuple, dev: torch.device):
        _, m, n, has_w, need_dw, need_db = key[:6]
        self.key, self.m, self.n, self.need_dw, self.need_db, self.kept = key, m, n, need_dw, need_db, None
        self.progs = progs = _programs(m, dev)
        self.per_prog = cdiv(m, progs)
        self.block_c = min(next_power_of_2(n), 256)
        self.k = need_dw + need_db
        # (the column sums' launcher kept: kernel[grid] builds one at every call)
        self.column_sum = _column_sum[(cdiv(n, self.block_c), self.k)]
        self.constexprs = {"HAS_W": has_w, "NEED_DW": need_dw, "NEED_DB": need_db, "BLOCK_N": next_power_of_2(n)}

    def launch(self, geo: tuple, dy: torch.Tensor, x: torch.Tensor, weight, mean, rstd, w_dtype: torch.dtype,
               b_dtype: torch.dtype, dx: torch.Tensor) -> tuple:
        """The launches into the caller's ``dx`` (contiguous, ``x``'s shape; ``geo``: ``x``'s
        :func:`_geometry`): ``(dx, dweight, dbias)``."""
        m, n, k, progs = self.m, self.n, self.k, self.progs
        need_dw, need_db = self.need_dw, self.need_db
        # One buffer of partial sums and one column-sum launch for both parameter gradients.
        if not k:
            part = dx
        elif rstd.dtype is _F32:  # (the forward's statistics are) an fp32 buffer without keywords
            part = rstd.new_empty(progs, k * n)
        else:
            part = torch.empty(progs, k * n, dtype=_F32, device=x.device)
        if m > 0:
            args = (dy, x, weight if weight is not None else x, mean, rstd, dx, part, m, n, self.per_prog, *geo[2:])
            kept = self.kept
            if kept is not None and (_ln_bwd.configs[0] if kept[0] is None else _ln_bwd.cache.get(kept[0])) is kept[1]:
                # (_launch_kept, inline: a frame less)
                if kept[4]:
                    kept[2](*args, *kept[3], **kept[4])
                else:
                    kept[2](*args, *kept[3])
            else:
                _launch(_ln_bwd, self.key, (progs,), args, self.constexprs)
                self.kept = _PLANS.get(self.key)
        # (new_empty without keywords where the weight's dtype is the answer: each keyword costs ~2,000
        # instructions)
        dw = (weight.new_empty(n) if weight.dtype is w_dtype else torch.empty(n, dtype=w_dtype, device=x.device)) \
            if need_dw else None
        db = (weight.new_empty(n) if weight is not None and weight.dtype is b_dtype else
              torch.empty(n, dtype=b_dtype, device=x.device)) if need_db else None
        if k:
            if m == 0:
                for t in (dw, db):
                    if t is not None:
                        t.zero_()
            else:
                # BLOCK_P, BLOCK_C by position (see _launch_kept)
                self.column_sum(part, dw if need_dw else db, db if need_db else dw, progs, n, k * n, 16, self.block_c)
        return dx, dw, db


def bwd_plan(key: tuple, dev: torch.device) -> _BwdPlan:
    """The backward plan of ``key`` on ``dev`` (made and kept where new)."""
    p = _BWD.get(key)
    if p is None:
        p = _BWD[key] = _BwdPlan(key, dev)
    return p


def backward(dy: torch.Tensor, x: torch.Tensor, weight, mean, rstd, need_dw: bool, need_db: bool,
             w_dtype: torch.dtype, b_dtype: torch.dtype):
    """``(dx, dweight, dbias)``; ``dy`` contiguous with ``x``'s shape, ``dx`` contiguous."""
    geo = _geometry(x)
    dx = _contiguous_like(x)
    w = weight if weight is not None else x
    dev = x.device
    key = (True, geo[0], geo[1], weight is not None, need_dw, need_db, dy.dtype, x.dtype, w.dtype, mean.dtype,
           rstd.dtype, dev.type, dev.index)
    return (_BWD.get(key) or bwd_plan(key, dev)).launch(geo, dy, x, weight, mean, rstd, w_dtype, b_dtype, dx)
