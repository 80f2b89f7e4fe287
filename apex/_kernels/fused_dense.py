"""One tiled GEMM with fused prologues and epilogues, the building block of ``apex.ops.fused_dense``.

``C[M, N] = epilogue(prologue_A(A[M, K]) @ prologue_B(B[K, N]))`` with fp32 accumulation, where

* ``prologue_A``: ``A ← act(A)`` (``PRO_A``, a deferred GELU of the previous layer) and/or
  ``A ← A · act'(AUX_A)`` (``DACT_A``, the activation derivative of the layer being differentiated,
  computed from its saved output, or its pre-activation for GELU);
* ``prologue_B``: ``B ← act(B)`` (``PRO_B``);
* ``epilogue``: ``+ bias[n]``, then ``act`` (``EPI_ACT``), then ``· act'(AUX_C)`` (``DACT_C``);
* ``ROWSUM``: the sum over ``K`` of the (prologued) ``A`` rows, written to ``DB[m]`` by the programs of
  the first column block: the bias gradient of a weight-gradient GEMM, reduced in the same pass.

Activation codes (Apex's ``mlp_cuda`` numbering, GELU added): 0 none, 1 ReLU, 2 sigmoid, 3 GELU with
the tanh approximation (cuBLASLt's). Derivatives: ReLU and sigmoid from the activation's output
(``y > 0``, ``y(1 − y)``), GELU from its input.

``A`` and ``B`` may have any strides (transposed views need no copy); ``C`` and the saved tensors
``AuxA``/``AuxC`` are contiguous, their strides implied by their shapes. fp16/bf16 operands go to ``tl.dot``
as they are (fp32 accumulation); fp32 operands use ``input_precision="ieee"`` unless the caller allows tf32. Under
the Triton interpreter bf16 operands are upcast to fp32 before the dot (the interpreter's bf16 dot is
wrong) and one fixed tile configuration, sized to the problem, is used.

Launchers: :func:`linear`, :func:`weight_grad` and :func:`input_grad` (a layer's three GEMMs, for any call);
``apex._kernels._fused_dense_chain.ChainPlan`` holds every launch of one eager chain call, derived once per key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from apex._kernels import _tuning
from apex._kernels._host import cdiv, interpreted, next_power_of_2

NONE, RELU, SIGMOID, GELU = 0, 1, 2, 3


@triton.jit
def _act(x, ACT: tl.constexpr):
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:
        x = tl.sigmoid(x)
    elif ACT == 3:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0  # tanh(u); libdevice is unavailable under the interpreter
        x = 0.5 * x * (1.0 + t)
    return x


# The interpreter's launches (big tiles, few programs): a constant of the kernels (see _host.interpreted).
_INTERP = interpreted(_act)


@triton.jit
def _dact(aux, ACT: tl.constexpr):
    """act'(·) from the saved tensor: the output for ReLU/sigmoid, the input for GELU."""
    if ACT == 1:
        d = tl.where(aux > 0.0, 1.0, 0.0)
    elif ACT == 2:
        d = aux * (1.0 - aux)
    else:
        u = 0.7978845608028654 * (aux + 0.044715 * aux * aux * aux)
        t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
        d = 0.5 * (1.0 + t) + 0.5 * aux * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * aux * aux)
    return d


@triton.jit
def _gemm_kernel(A, B, C, Bias, AuxA, AuxC, DB, M, N, K, s_am, s_ak, s_bk, s_bn,
                 PRO_A: tl.constexpr, DACT_A: tl.constexpr, AUX_T: tl.constexpr, PRO_B: tl.constexpr,
                 HAS_BIAS: tl.constexpr, EPI_ACT: tl.constexpr, DACT_C: tl.constexpr, ROWSUM: tl.constexpr,
                 UPCAST: tl.constexpr, PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GROUP_M: tl.constexpr):
    # C, AuxC ([M, N]) and AuxA are contiguous: their strides are implied (N, 1; AuxA [M, K] row-major, or
    # [K, M] where AUX_T), not arguments (fewer arguments, a cheaper launch).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    # Grouped ordering: GROUP_M row blocks share their B column blocks in L2.
    per_group = GROUP_M * num_pid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_mask = rm < M
    n_mask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if ROWSUM:
        rsum = tl.zeros((BM,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        k_mask = kk < K
        kk64 = kk.to(tl.int64)
        a_mask = m_mask[:, None] & k_mask[None, :]
        a = tl.load(A + rm64[:, None] * s_am + kk64[None, :] * s_ak, mask=a_mask, other=0.0)
        if PRO_A != 0 or DACT_A != 0 or ROWSUM:
            af = a.to(tl.float32)
            if PRO_A != 0:
                af = _act(af, PRO_A)
            if DACT_A != 0:
                if AUX_T:
                    x = tl.load(AuxA + rm64[:, None] + kk64[None, :] * M, mask=a_mask, other=0.0)
                else:
                    x = tl.load(AuxA + rm64[:, None] * K + kk64[None, :], mask=a_mask, other=0.0)
                af = af * _dact(x.to(tl.float32), DACT_A)
            af = tl.where(a_mask, af, 0.0)
            if ROWSUM:
                rsum += tl.sum(af, axis=1)
            a = af.to(A.dtype.element_ty)
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(B + kk64[:, None] * s_bk + rn64[None, :] * s_bn, mask=b_mask, other=0.0)
        if PRO_B != 0:
            b = tl.where(b_mask, _act(b.to(tl.float32), PRO_B), 0.0).to(B.dtype.element_ty)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PRECISION)
        else:
            acc += tl.dot(a, b, input_precision=PRECISION)

    c_mask = m_mask[:, None] & n_mask[None, :]
    if HAS_BIAS:
        bias = tl.load(Bias + rn, mask=n_mask, other=0.0).to(tl.float32)
        acc += bias[None, :]
    if EPI_ACT != 0:
        acc = _act(acc, EPI_ACT)
    if DACT_C != 0:
        y = tl.load(AuxC + rm64[:, None] * N + rn64[None, :], mask=c_mask, other=0.0)
        acc = acc * _dact(y.to(tl.float32), DACT_C)
    tl.store(C + rm64[:, None] * N + rn64[None, :], acc.to(C.dtype.element_ty), mask=c_mask)
    if ROWSUM:
        if pid_n == 0:  # every column block computed the same sums; one writes them
            tl.store(DB + rm, rsum.to(DB.dtype.element_ty), mask=m_mask)


def _pow2(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, next_power_of_2(max(n, 1))))


# (m, n, k, dtype) -> (launcher of the grid, constexprs ieee, constexprs tf32 allowed, launch options)
_PLANS = _tuning.plan_cache()


def _config(m: int, n: int, k: int, dtype: torch.dtype, hip: bool | None = None) -> dict:
    """The launch configuration of a shape. ``hip``: whether the target is an AMD GPU; None: asked of Triton's
    driver (the target a launch compiles for, which :func:`apex.testing.triton_compile.compile_only` sets)."""
    if _INTERP:
        # The interpreter pays per operation, not per element: one large tile per dimension.
        return dict(BM=_pow2(m, 16, 64), BN=_pow2(n, 16, 128), BK=_pow2(k, 16, 128), GROUP_M=8,
                    num_warps=4, num_stages=1)
    bm = 128 if m > 64 else 64
    bn = 128 if n > 64 else 64
    warps = 8 if bm * bn >= 128 * 128 else 4
    # num_stages None: the backend's default, which is the number wanted (Triton's HIPOptions 2, CUDAOptions 3).
    if hip is None:
        hip = triton.runtime.driver.active.get_current_target().backend == "hip"
    if hip:
        # AMD GPUs have 64 KB of LDS per workgroup: two stages of (BM + BN) x BK tiles must fit in it.
        return dict(BM=bm, BN=bn, BK=16 if dtype == torch.float32 else 32, GROUP_M=8, num_warps=warps,
                    num_stages=None)
    # NVIDIA (sm_80+: 164-228 KB of shared memory per block): three stages in flight.
    return dict(BM=bm, BN=bn, BK=32 if dtype == torch.float32 else 64, GROUP_M=8, num_warps=warps, num_stages=None)


def gemm(a: torch.Tensor, b: torch.Tensor, *, bias: torch.Tensor | None = None, epi_act: int = NONE,
         pro_a: int = NONE, dact_a: int = NONE, aux_a: torch.Tensor | None = None, pro_b: int = NONE,
         dact_c: int = NONE, aux_c: torch.Tensor | None = None, rowsum: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, allow_tf32: bool = False, trans_a: bool = False,
         trans_b: bool = False) -> torch.Tensor:
    """``C = epilogue(prologue(a) @ prologue(b))`` (see the module docstring); one launch.

    ``a`` is ``[M, K]`` and ``b`` ``[K, N]``, any strides; ``aux_a`` (needed with ``dact_a``) has ``a``'s
    shape, ``aux_c`` (needed with ``dact_c``) and the result ``C`` (contiguous, ``out_dtype``) are ``[M, N]``
    (the aux operands are read contiguous: a strided one is copied first); ``rowsum`` (``[M]``, written)
    receives the row sums of the prologued ``a``. ``trans_a``: ``a`` and ``aux_a`` are given as ``[K, M]``;
    ``trans_b``: ``b`` as ``[N, K]``.
    """
    # trans_a / trans_b: a (and aux_a) given as [K, M], b as [N, K] (a weight): their strides are swapped
    # here instead of a transposed view made by the caller (an operator call each). Each fact read once.
    if trans_a:
        k, m = a.shape
        sa1, sa0 = a.stride()
    else:
        m, k = a.shape
        sa0, sa1 = a.stride()
    if trans_b:
        n, k2 = b.shape
        sb1, sb0 = b.stride()
    else:
        k2, n = b.shape
        sb0, sb1 = b.stride()
    dt = a.dtype
    assert k == k2 and dt == b.dtype, (a.shape, b.shape, dt, b.dtype)
    # new_empty with integer sizes: ~1.5 µs less than torch.empty((m, n), device=..., dtype=...).
    c = a.new_empty(m, n) if out_dtype is None else a.new_empty(m, n, dtype=out_dtype)
    if m == 0 or n == 0:
        return c
    plan = _PLANS.get((m, n, k, dt))
    if plan is None:
        plan = _plan(m, n, k, dt)
    launch, ieee, tf32, options = plan
    # The aux operands are read at the strides their contiguous layout implies (see the kernel); absent, a
    # pointer the kernel does not read. AUX_T only where AuxA is read (no second compile of one kernel).
    if dact_a:
        if not aux_a.is_contiguous():
            aux_a = aux_a.contiguous()
        aux_t = trans_a
    else:
        aux_a, aux_t = a, False
    if dact_c:
        if not aux_c.is_contiguous():
            aux_c = aux_c.contiguous()
    else:
        aux_c = c
    # The constexprs positionally (PRO_A, DACT_A, AUX_T, PRO_B, HAS_BIAS, EPI_ACT, DACT_C, ROWSUM, then the
    # plan's UPCAST, PRECISION, BM, BN, BK, GROUP_M): each keyword costs a launch ~2,000 instructions of
    # dictionary building and binding.
    launch(a, b, c, c if bias is None else bias, aux_a, aux_c, c if rowsum is None else rowsum, m, n, k,
           sa0, sa1, sb0, sb1, pro_a, dact_a, aux_t, pro_b, bias is not None, epi_act, dact_c,
           rowsum is not None, *(tf32 if allow_tf32 else ieee), **options)
    return c


# The chain's three GEMMs, positionally (a keyword argument costs its binding, each call): gemm's work for
# those calls without its general branches. Operands come checked (apex.ops.fused_dense.check_chain).
def linear(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, epi_act: int, pro_a: int,
           allow_tf32: bool, plans: dict = _PLANS) -> torch.Tensor:
    """A layer's forward: ``gemm(a, w, bias=bias, epi_act=epi_act, pro_a=pro_a, allow_tf32=allow_tf32,
    trans_b=True)`` (``a`` ``[M, K]``, ``w`` ``[N, K]``)."""
    m, k = a.shape
    sa0, sa1 = a.stride()
    sb1, sb0 = w.stride()
    n = w.shape[0]
    c = a.new_empty(m, n)
    if m == 0 or n == 0:
        return c
    plan = plans.get((m, n, k, a.dtype))
    if plan is None:
        plan = _plan(m, n, k, a.dtype, plans)
    launch, ieee, tf32, options = plan
    if bias is None:
        launch(a, w, c, c, a, c, c, m, n, k, sa0, sa1, sb0, sb1, pro_a, NONE, False, NONE, False, epi_act, NONE,
               False, *(tf32 if allow_tf32 else ieee), **options)
    else:  # (the kernel reads the bias at unit stride: a strided view, e.g. a column, is copied)
        launch(a, w, c, bias.contiguous(), a, c, c, m, n, k, sa0, sa1, sb0, sb1, pro_a, NONE, False, NONE, True,
               epi_act, NONE, False, *(tf32 if allow_tf32 else ieee), **options)
    return c


def weight_grad(g: torch.Tensor, x: torch.Tensor, dact: int, aux: torch.Tensor | None, pro_b: int,
                db: torch.Tensor | None, allow_tf32: bool, plans: dict = _PLANS) -> torch.Tensor:
    """A layer's weight gradient ``(g · act'(aux))ᵀ @ pro_b(x)`` and, into ``db``, the bias gradient:
    ``gemm(g, x, dact_a=dact, aux_a=aux, pro_b=pro_b, rowsum=db, allow_tf32=allow_tf32, trans_a=True)``."""
    k, m = g.shape
    sa1, sa0 = g.stride()
    sb0, sb1 = x.stride()
    n = x.shape[1]
    c = g.new_empty(m, n)
    if m == 0 or n == 0:
        if n == 0 and db is not None:
            bias_grad_alone(g, dact, aux, db)
        return c
    plan = plans.get((m, n, k, g.dtype))
    if plan is None:
        plan = _plan(m, n, k, g.dtype, plans)
    launch, ieee, tf32, options = plan
    if dact:
        if not aux.is_contiguous():
            aux = aux.contiguous()
    else:
        aux = g
    launch(g, x, c, c, aux, c, c if db is None else db, m, n, k, sa0, sa1, sb0, sb1, NONE, dact, dact != NONE,
           pro_b, False, NONE, NONE, db is not None, *(tf32 if allow_tf32 else ieee), **options)
    return c


def bias_grad_alone(g: torch.Tensor, dact: int, aux: torch.Tensor | None, db: torch.Tensor) -> None:
    """``db`` of a layer whose input has no columns: the weight gradient is empty, so no GEMM runs whose
    epilogue would sum the rows of ``g · act'(aux)`` into ``db``; PyTorch sums them here instead."""
    if dact == RELU:
        g = torch.ops.aten.threshold_backward(g, aux, 0)
    elif dact == SIGMOID:
        g = torch.ops.aten.sigmoid_backward(g, aux)
    db.copy_(g.sum(0, dtype=torch.float32))


def input_grad(g: torch.Tensor, w: torch.Tensor, dact_a: int, aux_a: torch.Tensor | None, dact_c: int,
               aux_c: torch.Tensor | None, allow_tf32: bool, plans: dict = _PLANS) -> torch.Tensor:
    """A layer's input gradient ``(g · act'(aux_a)) @ w · act'(aux_c)``: ``gemm(g, w, dact_a=dact_a,
    aux_a=aux_a, dact_c=dact_c, aux_c=aux_c, allow_tf32=allow_tf32)``."""
    m, k = g.shape
    sa0, sa1 = g.stride()
    sb0, sb1 = w.stride()
    n = w.shape[1]
    c = g.new_empty(m, n)
    if m == 0 or n == 0:
        return c
    plan = plans.get((m, n, k, g.dtype))
    if plan is None:
        plan = _plan(m, n, k, g.dtype, plans)
    launch, ieee, tf32, options = plan
    if dact_a:
        if not aux_a.is_contiguous():
            aux_a = aux_a.contiguous()
    else:
        aux_a = g
    if dact_c:
        if not aux_c.is_contiguous():
            aux_c = aux_c.contiguous()
    else:
        aux_c = c
    launch(g, w, c, c, aux_a, aux_c, c, m, n, k, sa0, sa1, sb0, sb1, NONE, dact_a, False, NONE, False, NONE, dact_c,
           False, *(tf32 if allow_tf32 else ieee), **options)
    return c


def _plan(m: int, n: int, k: int, dt: torch.dtype, plans: dict | None = None) -> tuple:
    """The launch plan of a shape, kept in ``plans`` (default :data:`_PLANS`)."""
    # (the target query behind _config costs a few µs: once per shape and dtype). While torch.compile traces,
    # the target is torch's build instead: Dynamo cannot trace Triton's driver query (see _Traced).
    cfg = (_config(m, n, k, dt, torch.version.hip is not None) if torch.compiler.is_compiling()
           else _config(m, n, k, dt))
    # tf32 only for fp32 operands on a GPU (the interpreter computes in ieee); the interpreter's bf16 dot needs
    # fp32 operands.
    upcast = _INTERP and dt == torch.bfloat16
    tail = (cfg["BM"], cfg["BN"], cfg["BK"], cfg["GROUP_M"])
    ieee = (upcast, "ieee", *tail)
    tf32 = (upcast, "tf32", *tail) if dt == torch.float32 and not _INTERP else ieee
    # The grid's launcher (kernel[grid] builds it anew at every call) kept with the plan.
    # Launch options only where they differ from Triton's defaults (4 warps, the backend's stages): a keyword
    # argument costs a launch ~2,000 instructions; the interpreter takes none.
    options = {}
    if not _INTERP:
        if cfg["num_warps"] != 4:
            options["num_warps"] = cfg["num_warps"]
        if cfg["num_stages"] is not None:
            options["num_stages"] = cfg["num_stages"]
    plan = (_gemm_kernel[(cdiv(m, cfg["BM"]) * cdiv(n, cfg["BN"]),)], ieee, tf32, options)
    (_PLANS if plans is None else plans)[(m, n, k, dt)] = plan
    return plan


class _Traced:
    """:func:`linear`, :func:`weight_grad` and :func:`input_grad` as torch.compile traces them
    (``apex.ops.fused_dense`` takes them while tracing): each launch planned afresh, in a dict of the call's
    own, not looked up in :data:`_PLANS`. A traced lookup makes the graph guard on that module-level cache,
    which the tracing itself (or any eager call of the shape) then fills: the next call fails the guard and
    is traced again (on a GPU: MLP and FusedDense, whose shapes no earlier call had planned, made 8 and 5
    graphs in 3 compiled steps). Planned in the trace, the launch is ``_gemm_kernel[grid](...)``, which Dynamo
    records as a Triton kernel call with the plan's constants; the eager launchers keep their cached plans."""

    @staticmethod
    def linear(a, w, bias, epi_act, pro_a, allow_tf32):
        return linear(a, w, bias, epi_act, pro_a, allow_tf32, {})

    @staticmethod
    def weight_grad(g, x, dact, aux, pro_b, db, allow_tf32):
        return weight_grad(g, x, dact, aux, pro_b, db, allow_tf32, {})

    @staticmethod
    def input_grad(g, w, dact_a, aux_a, dact_c, aux_c, allow_tf32):
        return input_grad(g, w, dact_a, aux_a, dact_c, aux_c, allow_tf32, {})


traced = _Traced
