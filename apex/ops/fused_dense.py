"""Chains of dense layers with fused bias and activation: the engine of ``apex.mlp`` and ``apex.fused_dense``.

A chain of ``L`` layers computes ``a₀ = x``, ``aᵢ₊₁ = actᵢ(aᵢ Wᵢᵀ + bᵢ)`` with ``Wᵢ`` of shape
``[outᵢ, inᵢ]`` (``nn.Linear``'s layout) and ``actᵢ`` one of ``none``, ``relu``, ``sigmoid`` or ``gelu``
(the tanh approximation, cuBLASLt's ``GELU`` epilogue). The input may have any leading dimensions
(``[..., in₀]``; Apex required 2-D); they are flattened to rows.

Dtype policy: the input, weights and biases share one floating dtype (under ``torch.autocast`` the public
modules cast them to the autocast dtype first); products accumulate in fp32 (PyTorch's CPU and cuBLAS
matmuls do too); each layer's output is rounded once to that dtype. fp32 GEMMs use tf32 on GPUs only where
``torch.backends.cuda.matmul.allow_tf32`` allows it.

Checks: :mod:`apex.ops._fused_dense_checks`. Paths:

* PyTorch (CPU tensors, or ``APEX_BACKEND=torch``): ``torch.addmm`` per layer with the activation applied
  in place, and the backward ``nn.Sequential`` would run (``threshold_backward`` / ``sigmoid_backward`` /
  ``gelu_backward``, then two ``mm`` and a ``sum``), without its extra copies.
* Triton (``apex._kernels.fused_dense``): one GEMM launch per layer forward, bias and activation in its
  epilogue; a GELU is deferred into the next layer's operand load, so only its input is stored. Backward:
  two launches per layer: the weight gradient, whose launch also reduces the bias gradient, and the input
  gradient, whose epilogue multiplies by the previous layer's activation derivative.

Host cost: in plain eager mode the public entries (the modules, :func:`apply_chain`) launch a chain on the
Triton path from its plan (:mod:`apex.ops._dense_direct`): one dict lookup on the facts the checks read stands
for the checks, and every size, stride, grid and constexpr of the forward's and backward's launches is derived
once per key. torch.compile, ``torch.func``, dispatch modes, tracers and tensor subclasses take the general
code (``save_chain`` / ``chain_grads`` inside the chain's own ``autograd.Function``, :func:`apply_general`).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F

from apex._backend import select_tensor
from apex.ops._dense_direct import chain as _lean_chain
from apex.ops._dispatch import lazy_module

# (apex.ops.mlp and apex.fused_dense import these from here.)
from apex.ops._fused_dense_checks import ACTIVATIONS, GELU, NONE, RELU, SIGMOID, check_chain
from apex.ops._norm import check_devices

Tensor = torch.Tensor
_K = lazy_module("apex._kernels.fused_dense")
_any_autocast = torch._C._is_any_autocast_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_any_requires_grad = torch._C._any_requires_grad

_F64 = torch.float64


# ------------------------------------------------------------------------------------------ backend choice
def _use_triton(x: Tensor, *_: Tensor, compiling: bool | None = None) -> bool:
    """Whether a chain on input ``x`` runs the Triton path (the input decides, as ``select`` would);
    ``compiling`` as for :func:`check_chain`."""
    if x.dtype is _F64:  # (dtypes are singletons: no rich comparison)
        return False
    if torch.compiler.is_compiling() if compiling is None else compiling:
        # Under torch.compile the backend context cannot be read; CPU tensors take the PyTorch path (which
        # the compiler traces), GPU tensors Triton, as "auto" would choose.
        return x.is_cuda
    return select_tensor(x) == "triton"


# --------------------------------------------------------------------------------------------- forward
def chain_forward(x2: Tensor, weights, biases, acts) -> tuple[Tensor, list, list, bool]:
    """Forward of a chain on 2-D input rows, without autograd.

    Returns ``(output, outs, pres, triton)``: what the backward needs. ``outs[i]`` is layer ``i``'s stored
    output (its activation output, or, on the Triton path, its pre-activation where the activation is a
    GELU deferred into the next layer); ``pres[i]`` the pre-activation of a GELU layer on the PyTorch path.
    """
    # A GELU on the last layer cannot be deferred into a next one: the PyTorch path (Apex's chains never end so).
    if _use_triton(x2) and acts[-1] != GELU:
        out, outs = _forward_triton(x2, weights, biases, acts)
        return out, outs, [None] * len(weights), True
    return _forward_torch(x2, weights, biases, acts)


def _forward_triton(x2: Tensor, weights, biases, acts, compiling: bool = True) -> tuple[Tensor, list]:
    """The Triton chain: one GEMM launch a layer; returns the output and every layer's stored output."""
    linear, tf32 = _kernels(compiling).linear, _allow_tf32()
    if len(weights) == 1:  # one layer (FusedDense): no loop
        act = acts[0]
        out = linear(x2, weights[0], biases[0] if biases else None, NONE if act == GELU else act, NONE, tf32)
        return out, [out]
    outs = []
    inp, pro = x2, NONE
    for i, w in enumerate(weights):
        act = acts[i]
        inp = linear(inp, w, biases[i] if biases else None, NONE if act == GELU else act, pro, tf32)
        outs.append(inp)
        pro = GELU if act == GELU else NONE
    return inp, outs


def _forward_torch(x2: Tensor, weights, biases, acts) -> tuple[Tensor, list, list, bool]:
    outs: list = []
    pres: list = [None] * len(weights)
    dt, ct = x2.dtype, _compute_dtype(x2)
    inp = x2.to(ct)
    for i, w in enumerate(weights):
        b = biases[i].to(ct) if biases else None
        z = torch.addmm(b, inp, w.t().to(ct)) if b is not None else torch.mm(inp, w.t().to(ct))
        if acts[i] == RELU:
            z.relu_()
        elif acts[i] == SIGMOID:
            z.sigmoid_()
        elif acts[i] == GELU:
            pres[i] = z.to(dt)
            z = F.gelu(z, approximate="tanh")
        outs.append(z.to(dt))  # saved (and returned) rounded once to the input dtype
        inp = z
    return outs[-1], outs, pres, False


@functools.cache
def _cpu_half_gemm_is_fast(dtype: torch.dtype) -> bool:
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The GEMM dtype of the PyTorch path: the input's, except fp16/bf16 on CPUs without native half
    matmuls (no AVX512-BF16/AMX), where PyTorch's half GEMM is ~30x slower than fp32 (measured, 512x512):
    there the operands are upcast to fp32, accumulated in fp32 as PyTorch's half GEMM does, and each result
    is rounded once to the input dtype."""
    if x.dtype in (torch.float16, torch.bfloat16) and x.device.type == "cpu" and not _cpu_half_gemm_is_fast(x.dtype):
        return torch.float32
    return x.dtype


# What torch.backends.cuda.matmul.allow_tf32 returns, without its module __getattr__ (~1.3 µs a call).
_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32)
_LOADED: list = []  # the kernels' module, once an eager call has loaded it


def _kernels(compiling: bool):
    """The GEMM launchers: the kernels' module, or while torch.compile traces its ``traced`` launchers (which
    plan each launch in the trace instead of reading the module's plan cache, see there). ``compiling``
    False: the caller knows it is not tracing (no tracing query). The list is not read while tracing: the
    graph would guard on it, which a later eager call fills."""
    if compiling and torch.compiler.is_compiling():
        return _K().traced
    if not _LOADED:
        _LOADED.append(_K())
    return _LOADED[0]


# -------------------------------------------------------------------------------------------- backward
def chain_backward(dy2: Tensor, x2: Tensor, weights, has_bias: bool, outs, pres, acts, triton: bool,
                   need_dx: bool = True, need_w: bool = True) -> tuple[Tensor | None, list, list]:
    """Gradients ``(dx, [dWᵢ], [dbᵢ])`` of a chain from ``chain_forward``'s saved tensors."""
    if triton:
        return _backward_triton(dy2, x2, weights, has_bias, outs, acts, need_dx, need_w)
    n = len(weights)
    dws: list = [None] * n
    dbs: list = [None] * n
    dx = None
    dt, ct = x2.dtype, _compute_dtype(x2)
    g = dy2.to(ct)
    for i in reversed(range(n)):
        if acts[i] == RELU:
            g = torch.ops.aten.threshold_backward(g, outs[i].to(ct), 0)
        elif acts[i] == SIGMOID:
            g = torch.ops.aten.sigmoid_backward(g, outs[i].to(ct))
        elif acts[i] == GELU:
            g = torch.ops.aten.gelu_backward(g, pres[i].to(ct), approximate="tanh")
        inp = (outs[i - 1] if i > 0 else x2).to(ct)
        if need_w:
            dws[i] = g.t().mm(inp).to(dt)
            if has_bias:
                dbs[i] = g.sum(0).to(dt)
        if i > 0:
            g = g.mm(weights[i].to(ct))
        elif need_dx:
            dx = g.mm(weights[i].to(ct)).to(dt)
    return dx, dws, dbs


def _backward_triton(dy2, x2, weights, has_bias, outs, acts, need_dx, need_w, compiling=True):
    k, tf32 = _kernels(compiling), _allow_tf32()
    weight_grad, input_grad = k.weight_grad, k.input_grad
    n = len(weights)
    dws: list = [None] * n
    dbs: list = [None] * n
    dx = None
    g = dy2
    # The top layer's activation derivative is applied as its gradient is loaded (both GEMMs below);
    # every lower layer's is applied in the epilogue of the input-gradient GEMM that produces its gradient.
    # (outs[-1] is needed, and saved, only where the top layer has an activation.)
    dact, aux = (acts[-1], outs[-1]) if acts[-1] != NONE else (NONE, None)
    for i in range(n - 1, -1, -1):
        w = weights[i]
        if need_w:
            db = w.new_empty(w.shape[0]) if has_bias else None
            if i > 0:
                dws[i] = weight_grad(g, outs[i - 1], dact, aux, GELU if acts[i - 1] == GELU else NONE, db, tf32)
            else:
                dws[i] = weight_grad(g, x2, dact, aux, NONE, db, tf32)
            dbs[i] = db
        if i > 0:
            g = input_grad(g, w, dact, aux, acts[i - 1], outs[i - 1], tf32)
        elif need_dx:
            dx = input_grad(g, w, dact, aux, NONE, None, tf32)
        dact, aux = NONE, None
    return dx, dws, dbs


# ---------------------------------------------------------------------------------------- autograd
def save_chain(ctx, acts, has_bias: bool, input: Tensor, params) -> Tensor:
    """Run a chain's forward inside an autograd ``Function.forward`` and save what its backward needs."""
    n = len(acts)
    compiling = torch.compiler.is_compiling()  # read once
    # Rows already: no view in or out. Not while tracing: torch 2.11's torch.compile computed a wrong
    # output for a Function returning the very tensor it saved (seen on the GPU machine; a view is fine).
    two_d = input.dim() == 2 and not compiling
    x2 = input if two_d else input.reshape(-1, input.shape[-1])
    weights = params[:n]
    if acts[-1] != GELU and _use_triton(x2, compiling=compiling):  # (chain_forward's choice, made here once)
        out, outs = _forward_triton(x2, weights, params[n:] if has_bias else None, acts, compiling)
        # The top layer's output only where its activation's derivative needs it; no GELU pre-activations.
        ctx.save_for_backward(x2, *weights, *outs[:-1], out if acts[-1] != NONE else None)
        # (last: whether the forward was traced; an eager forward has loaded the kernels' module the
        # backward then reads without the tracing query)
        ctx.chain = (acts, has_bias, True, None if two_d else input.shape, compiling)
    else:
        out, outs, pres, _ = _forward_torch(x2, list(weights), list(params[n:]) if has_bias else [], acts)
        ctx.chain = (acts, has_bias, False, None if two_d else input.shape, [p is not None for p in pres])
        ctx.save_for_backward(x2, *weights, *outs, *[p for p in pres if p is not None])
    return out if two_d else out.view(*input.shape[:-1], out.shape[-1])


def chain_grads(ctx, grad_out: Tensor, input_index: int) -> tuple[Tensor | None, list, list]:
    """The gradients ``(dx, dweights, dbiases)`` for a ``Function`` whose forward called :func:`save_chain`;
    ``input_index`` is the position of the input among ``forward``'s arguments (the parameters follow it)."""
    acts, has_bias, triton, in_shape, extra = ctx.chain  # extra: the forward's tracing answer, or has_pre
    n = len(acts)
    saved = ctx.saved_tensors
    x2, weights, outs = saved[0], saved[1:1 + n], saved[1 + n:1 + 2 * n]
    needs = ctx.needs_input_grad
    need_dx = needs[input_index]
    need_w = True in needs[input_index + 1:]
    dy2 = grad_out if grad_out.dim() == 2 else grad_out.reshape(-1, grad_out.shape[-1])
    if dy2.dtype != x2.dtype:
        dy2 = dy2.to(x2.dtype)
    if triton:  # kernels only: torch.autocast changes nothing there
        dx, dws, dbs = _backward_triton(dy2, x2, weights, has_bias, outs, acts, need_dx, need_w, extra)
    else:
        more = iter(saved[1 + 2 * n:])
        pres = [next(more) if has else None for has in extra]
        dev = x2.device.type
        # Entering torch.autocast costs more than a launch: only where it is on (off it changes nothing).
        with torch.autocast(dev, enabled=False) if torch.is_autocast_enabled(dev) else contextlib.nullcontext():
            dx, dws, dbs = chain_backward(dy2, x2, list(weights), has_bias, list(outs), pres, acts, False,
                                          need_dx, need_w)
    if dx is not None and in_shape is not None:
        dx = dx.view(in_shape)
    return dx, dws, (dbs if has_bias else [])


class DenseChainFunction(torch.autograd.Function):
    """``apply(acts, has_bias, input, *weights, *biases)``: a differentiable chain (input ``[..., in]``)."""

    @staticmethod
    def forward(ctx, acts, has_bias, input, *params):
        return save_chain(ctx, acts, has_bias, input, params)

    @staticmethod
    def backward(ctx, grad_out):
        dx, dws, dbs = chain_grads(ctx, grad_out, 2)
        return (None, None, dx, *dws, *dbs)


def autocast_args(*args):
    """Cast floating tensors to the autocast dtype when ``torch.autocast`` is on for their device."""
    dev = next((a.device.type for a in args if isinstance(a, Tensor)), "cpu")
    if not torch.is_autocast_enabled(dev):
        return args, dev
    dtype = torch.get_autocast_dtype(dev)
    return tuple(a.to(dtype) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args), dev


def apply_chain(fn: type[torch.autograd.Function], lead: tuple, args: tuple, weights: slice, biases: slice,
                acts: tuple, compiling: bool | None = None) -> Tensor:
    """``fn.apply(*lead, *args)`` for a chain's public entry: ``args`` (the input first) cast under
    ``torch.autocast``, then checked (``weights``/``biases``: slices of ``args``). In plain eager mode a call on
    the Triton path takes its plan instead (:func:`apex.ops._dense_direct.chain`); else :func:`apply_general`.
    ``compiling``: ``torch.compiler.is_compiling()`` where the caller has asked it (None: asked here)."""
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    if not compiling:
        ws = args[weights]
        out = _lean_chain(acts, (args[0], *ws, *args[biases]), len(ws))
        if out is not None:
            return out
    return apply_general(fn, lead, args, weights, biases, acts, compiling)


def apply_general(fn: type[torch.autograd.Function], lead: tuple, args: tuple, weights: slice, biases: slice,
                  acts: tuple, compiling: bool | None = None) -> Tensor:
    """:func:`apply_chain` without the plans (where they answered None). Autocast is read once, and entered
    (~6 µs) only where it is on; outside ``torch.func`` transforms and tracing the C++ ``Function.apply`` is
    called without its Python wrapper (which unwraps ``torch.func``'s dead wrappers)."""
    x = args[0]
    if compiling is None:
        compiling = torch.compiler.is_compiling()
    # Whether any device's autocast is on, in one call; only then the input's device type (autocast is per
    # device: a CUDA input under CUDA autocast) and the cast.
    if compiling or _any_autocast():
        dev = x.device.type if isinstance(x, Tensor) else "cpu"
        if torch.is_autocast_enabled(dev):
            args, dev = autocast_args(*args)
            check_chain(args[0], args[weights], args[biases], acts, compiling)
            with torch.autocast(dev, enabled=False):
                return fn.apply(*lead, *args)
    ws, bs = args[weights], args[biases]
    if compiling or _functorch_active():
        check_chain(x, ws, bs, acts, compiling)
        return fn.apply(*lead, *args)
    check_chain(x, ws, bs, acts, False)
    if not (torch.is_grad_enabled() and _any_requires_grad(*args)):
        # Nothing to record: the chain itself, without the Function's context and saved tensors
        # (chain_forward's choice, eager: no tracing queries).
        two_d = x.dim() == 2
        x2 = x if two_d else x.reshape(-1, x.shape[-1])
        if acts[-1] != GELU and _use_triton(x2, compiling=False):
            out = _forward_triton(x2, ws, bs, acts, False)[0]
        else:
            out = _forward_torch(x2, ws, bs, acts)[0]
        return out if two_d else out.view(*x.shape[:-1], out.shape[-1])
    apply = _CPP_APPLY.get(fn)
    if apply is None:
        apply = _CPP_APPLY[fn] = super(torch.autograd.Function, fn).apply
    return apply(*lead, *args)


_CPP_APPLY: dict = {}  # Function class -> its C++ apply (super(...).apply builds a proxy each call)


def dense_chain(input: Tensor, weights, biases, activations) -> Tensor:
    """Differentiable chain ``actᵢ(aᵢ Wᵢᵀ + bᵢ)``; ``activations`` are names or codes, one per layer.

    Under ``torch.autocast`` the input and parameters are cast to the autocast dtype (gradients flow back to
    the originals in their dtypes).
    """
    acts = tuple(ACTIVATIONS[a] if isinstance(a, str) and a in ACTIVATIONS else a for a in activations)
    biases = list(biases) if biases else []
    weights = list(weights)
    args, dev = autocast_args(input, *weights, *biases)
    x, ws, bs = args[0], list(args[1:1 + len(weights)]), list(args[1 + len(weights):])
    check_chain(x, ws, bs, acts)
    if not torch.is_autocast_enabled(dev):  # entering torch.autocast costs more than a launch
        return DenseChainFunction.apply(acts, bool(bs), x, *ws, *bs)
    with torch.autocast(dev, enabled=False):
        return DenseChainFunction.apply(acts, bool(bs), x, *ws, *bs)


# ------------------------------------------------------------------------------------ functional entry
def fused_dense(input: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``input @ weightᵀ + bias``, fused (bias in the GEMM's epilogue, bias gradient in the weight GEMM)."""
    return dense_chain(input, [weight], [bias] if bias is not None else [], (NONE,))


def fused_dense_gelu_dense(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor
                           ) -> Tensor:
    """``gelu_tanh(input @ weight1ᵀ + bias1) @ weight2ᵀ + bias2``."""
    if bias1 is None or bias2 is None:
        raise ValueError("fused_dense_gelu_dense needs both bias1 and bias2 (as Apex's FusedDenseGeluDense)")
    return dense_chain(input, [weight1, weight2], [bias1, bias2], (GELU, NONE))


# ------------------------------------------------------------- Apex's ``fused_dense_cuda`` entry points
def _two_d(name: str, t: Tensor) -> Tensor:
    if not isinstance(t, Tensor) or t.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor [batch, features], got "
                         f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
    return t


def linear_bias_forward(input: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """``fused_dense_cuda.linear_bias_forward``: ``input @ weightᵀ + bias`` (no autograd)."""
    check_chain(_two_d("input", input), [weight], [bias], (NONE,))
    return chain_forward(input, [weight], [bias], (NONE,))[0]


def linear_bias_backward(input: Tensor, weight: Tensor, d_output: Tensor) -> list[Tensor]:
    """``fused_dense_cuda.linear_bias_backward``: ``[d_input, d_weight, d_bias]``."""
    check_chain(_two_d("input", input), [weight], [], (NONE,))
    check_devices(input, ("d_output", d_output))
    dx, dws, dbs = chain_backward(_two_d("d_output", d_output), input, [weight], True, [None], [None], (NONE,),
                                  _use_triton(input, weight))
    return [dx, dws[0], dbs[0]]


def linear_gelu_linear_forward(input: Tensor, weight1: Tensor, bias1: Tensor, weight2: Tensor, bias2: Tensor
                               ) -> list[Tensor]:
    """``fused_dense_cuda.linear_gelu_linear_forward``: ``[output1, output2, gelu_in]`` where
    ``gelu_in = input @ weight1ᵀ + bias1``, ``output1 = gelu_tanh(gelu_in)`` and
    ``output2 = output1 @ weight2ᵀ + bias2``."""
    check_chain(_two_d("input", input), [weight1, weight2], [bias1, bias2], (GELU, NONE))
    output2, outs, pres, triton = chain_forward(input, [weight1, weight2], [bias1, bias2], (GELU, NONE))
    if triton:  # the Triton chain stores only the GELU's input
        return [F.gelu(outs[0], approximate="tanh"), output2, outs[0]]
    return [outs[0], output2, pres[0]]


def linear_gelu_linear_backward(input: Tensor, gelu_in: Tensor, output1: Tensor, weight1: Tensor,
                                weight2: Tensor, d_output2: Tensor) -> list[Tensor]:
    """``fused_dense_cuda.linear_gelu_linear_backward``: ``[d_input, d_weight1, d_bias1, d_weight2, d_bias2]``."""
    check_chain(_two_d("input", input), [weight1, weight2], [], (GELU, NONE))
    check_devices(input, ("gelu_in", gelu_in), ("output1", output1), ("d_output2", d_output2))
    triton = _use_triton(input, weight1, weight2)
    outs = [gelu_in if triton else output1, None]  # the Triton backward recomputes the GELU from its input
    dx, dws, dbs = chain_backward(_two_d("d_output2", d_output2), input, [weight1, weight2], True, outs,
                                  [gelu_in, None], (GELU, NONE), triton)
    return [dx, dws[0], dbs[0], dws[1], dbs[1]]
