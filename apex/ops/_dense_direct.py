"""The lean eager path of the dense chains on the Triton path (``FusedDense``, ``FusedDenseGeluDense``, ``MLP`` and
their functional forms): a plan per argument layout and one plain ``autograd.Function`` that allocates and
launches from it.

Everything such a call derives besides its tensors follows from the chain's activation codes and a few facts of
its tensors: whether ``check_chain`` passes (it reads each tensor's type, dtype, shape and device), the GEMMs'
sizes, the strides the launches take (the input's rows', each weight's), whether each bias is contiguous (the
launchers read it at unit stride, copying a strided one) and the kernels' launch plans. The key holds every one
of those: ``(acts, x.shape, x layout, x.dtype, x device, per weight (shape, layout, dtype, device), per bias
(shape, is_contiguous(), dtype, device))``, a layout being True for a contiguous tensor (its strides are implied
by its shape; ``is_contiguous()`` costs less than ``stride()``), else its strides. Devices without a device
object (``.device`` builds one): a CUDA input's ``get_device()`` and each parameter's (a CPU or meta parameter
answers -1, which no CUDA input's index equals: such a key never passes the checks); a CPU input's -1 and each
parameter's ``is_cpu`` (the checks need it on the CPU); any other device as ``.device``. A parameter's facts are
read at every call: ``param.data = ...`` changes them without changing the parameter.

A hit stands for the checks and launches what the general path's launchers (``linear``, ``weight_grad``,
``input_grad``) launch, with the same arguments (:class:`apex._kernels._fused_dense_chain.ChainPlan`, kept in its
``CHAINS``): the same bits. A miss is checked first (the general path's errors, in its order) and planned only
where the Triton kernels run the call as a plan does: not fp64 and not a chain ending in a GELU (the PyTorch
path's), every bias contiguous. A key that is not planned is kept as False (the next such call goes to the
general path at once).

A call that repeats its weight's last planned call (the usual: one module, one layout, every step) skips the
key: the plan is kept with a ``torch._C._dynamo.guards.TensorGuards`` of that call's tensors (under its first
weight's ``id`` in ``CHAINS``), whose ``check`` compares, in one C call, each tensor's exact type, dtype, device,
sizes, strides, ``requires_grad`` and dispatch keys as the thread's include/exclude sets make them: more than the
key holds, so a pass stands for the key (any object of that ``id`` passes only with the same facts). A dispatch
mode, a ``torch.func`` transform, the JIT tracer, inference mode and autocast each add keys there, so no call
under one passes a guard made outside them (the key path asks them; ``test_dense_lean`` checks both). The
backward keeps its launches the same way, with a guard of the gradient and the saved tensors (a saved-tensor hook's
copy in another layout fails it).

Asked at every call, not planned: the backend (on the key path before the key: the CPU's default PyTorch path
pays for no key; an error is the general path's to raise, in its order), ``torch.compile``/``torch.export``,
dispatch modes, ``torch.func`` transforms, tracers, autocast (the general path casts to the autocast dtype) and
tensor subclasses (the general path: the chain's own Function, as before), whether grad mode is on, and the tf32
flag. The backward takes the general code (``apex.ops.fused_dense._backward_triton``, the general Functions' own)
wherever grad mode is on (a double backward), the gradient is a subclass, or under compile-time machinery, and
wherever a saved-tensor hook gave a saved output back in another layout. The plan's backward launches are looked
up again after ``_tuning.invalidate`` (:data:`apex.ops._lean.EPOCH`), as the general launchers would.

The output's ``grad_fn`` is ``_DirectChainBackward`` (the general path's is ``FusedDenseFuncBackward``,
``MlpFunctionBackward``, ...).
"""

from __future__ import annotations

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex.ops._dispatch import _PLAIN, _PLAIN_OR_NONE
from apex.ops._fused_dense_checks import GELU, NONE, check_chain
from apex.ops._lean import EPOCH as _EPOCH
from apex.ops._lean import epoch as _epoch
from apex.ops._lean import triton_takes as _triton_takes

try:  # (torch's C guard of a tensor's facts; absent, every call builds its key)
    from torch._C._dynamo.guards import TensorGuards as _Guards
except ImportError:  # pragma: no cover
    _Guards = None

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_any_autocast = torch._C._is_any_autocast_enabled
_grad_enabled = torch.is_grad_enabled
_F64 = torch.float64
# What torch.backends.cuda.matmul.allow_tf32 returns, without its module __getattr__ (~1.3 µs a call).
_allow_tf32 = getattr(torch._C, "_get_cublas_allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32)
_ONE = (NONE,)  # FusedDense's codes
_LOADED: list = []  # the chain plans' module, once a plan was made (no Triton import when apex is)


def _chains():
    if not _LOADED:
        import apex._kernels._fused_dense_chain as chains

        _LOADED.append(chains)
    return _LOADED[0]


def dense(input: object, weight: object, bias: object) -> Tensor | None:
    """``input @ weightᵀ + bias`` (``bias`` None: none) on its plan: the output, or None where the general path
    must take the call (nothing done)."""
    if _is_compiling():  # (torch.compile and torch.export trace the general path)
        return None
    args = (input, weight) if bias is None else (input, weight, bias)
    # The weight's last planned call, where every fact of this call's tensors is that call's (one C call, which
    # also fails under a dispatch mode, a torch.func transform, a tracer or autocast: see the module docstring);
    # else the key.
    hit = _LOADED[0].CHAINS.get(id(weight)) if _LOADED else None
    if hit is not None and hit[2] == _ONE and hit[3] == len(args) and hit[0].check(*args):
        plan = hit[1]
        if not _triton_takes(plan.on_gpu, input):
            return None
    else:
        plan = _dense_plan(args)
        if not plan:
            return None
    if _grad_enabled():  # (grad mode alone decides: no input needing a gradient, no graph, as the plain forward)
        return _direct(plan, *args)
    return plan.forward(input, args[1:], _allow_tf32())


def chain(acts: tuple, args: tuple, n: int) -> Tensor | None:
    """A chain of ``n`` layers with codes ``acts`` on ``args = (input, *weights, *biases)`` (biases: none or
    ``n``) on its plan: the output, or None where the general path must take the call (nothing done). The
    callers have asked torch.compile (off)."""
    hit = _LOADED[0].CHAINS.get(id(args[1])) if _LOADED and n else None
    if hit is not None and hit[2] == acts and hit[3] == len(args) and hit[0].check(*args):  # (as dense's)
        plan = hit[1]
        if not _triton_takes(plan.on_gpu, args[0]):
            return None
    else:
        plan = _chain_plan(acts, args, n)
        if not plan:
            return None
    if _grad_enabled():
        return _direct(plan, *args)
    return plan.forward(args[0], args[1:], _allow_tf32())


def _on_gpu(x: object) -> bool | None:
    """``x.is_cuda`` where the key path may plan a call on input ``x``; None where the general path takes it
    without a key: under compile-time machinery or autocast (the general path casts), for a tensor subclass or
    not a tensor, on another backend (the general path raises a backend's error, in its order)."""
    if (_dispatch_modes() or _are_functorch_transforms_active() or _is_tracing() or _any_autocast()
            or type(x) not in _PLAIN):
        return None
    on_gpu = x.is_cuda
    return on_gpu if _triton_takes(on_gpu, x) else None


def _dense_plan(args: tuple) -> object:
    """:func:`dense`'s plan by its key (see the module docstring for the devices' facts); False where the
    general path must take the call."""
    input, weight = args[0], args[1]
    on_gpu = _on_gpu(input)
    bias = args[2] if len(args) == 3 else None
    if on_gpu is None or type(weight) not in _PLAIN or type(bias) not in _PLAIN_OR_NONE:
        return False  # (the general path, its checks and errors; nothing kept)
    if on_gpu:
        dev, wdev = input.get_device(), weight.get_device()
    elif input.is_cpu:
        dev, wdev = -1, weight.is_cpu
    else:
        dev, wdev = input.device, weight.device
    key = (_ONE, input.shape, input.is_contiguous() or input.stride(), input.dtype, dev, weight.shape,
           weight.is_contiguous() or weight.stride(), weight.dtype, wdev)
    if bias is not None:
        key += (bias.shape, bias.is_contiguous(), bias.dtype,
                bias.get_device() if on_gpu else bias.is_cpu if dev == -1 else bias.device)
    return _planned(key, _ONE, args, 1)


def _chain_plan(acts: tuple, args: tuple, n: int) -> object:
    """:func:`chain`'s plan by its key; False where the general path must take the call."""
    x = args[0]
    on_gpu = _on_gpu(x)
    if on_gpu is None:
        return False
    for t in args:
        if type(t) not in _PLAIN:
            return False  # (a subclass, or not a tensor: the general path, its checks and errors)
    cpu = not on_gpu and x.is_cpu
    key = [acts, x.shape, x.is_contiguous() or x.stride(), x.dtype, x.get_device() if on_gpu else -1 if cpu
           else x.device]
    for i in range(1, len(args)):  # (the weights' layouts, the biases' contiguity)
        t = args[i]
        key += (t.shape, t.is_contiguous() or t.stride() if i <= n else t.is_contiguous(), t.dtype,
                t.get_device() if on_gpu else t.is_cpu if cpu else t.device)
    return _planned(tuple(key), acts, args, n)


def _planned(key: tuple, acts: tuple, args: tuple, n: int) -> object:
    """The plan of ``key``: kept, or made for a key not seen yet (checked: the general path's errors) or False
    where the Triton path does not run the call as a plan does. A plan is kept with the guard of this call's
    tensors, under its first weight's ``id`` (any object of that id passes only with the same facts)."""
    chains = _chains()
    plan = chains.CHAINS.get(key)
    if plan is None:
        x, ws, bs = args[0], args[1:n + 1], args[n + 1:]
        check_chain(x, ws, bs, acts, False)
        plan = False
        # (the general path's choice: fp64 and a chain ending in a GELU take the PyTorch path)
        if acts[-1] != GELU and x.dtype is not _F64 and all(b.is_contiguous() for b in bs):
            plan = chains.ChainPlan(acts, bool(bs), x, ws)
            plan.epoch = _epoch()
        chains.keep_chain(key, plan)
    if plan and _Guards is not None:
        guard = _Guards(*args, dynamic_dims_sizes=None, dynamic_dims_strides=None)
        chains.keep_chain(id(args[1]), (guard, plan, acts, len(args)))
    return plan


class _DirectChain(torch.autograd.Function):
    """The eager Triton chain with a gradient: ``apply(plan, input, *weights, *biases)`` launches the plan's
    GEMMs (what the general Functions' ``save_chain`` and ``chain_grads`` launch, with the same arguments and
    saved tensors); its backward, or that general code wherever it is needed."""

    @staticmethod
    def forward(ctx, plan, x, *params):
        ctx.plan = plan
        return plan.forward(x, params, _allow_tf32(), ctx.save_for_backward)

    @staticmethod
    def backward(ctx, grad_out):
        plan = ctx.plan
        # (autograd hands a gradient of the output's shape and dtype: 2-D exactly when the input was)
        g = grad_out if plan.in_shape is None else grad_out.reshape(-1, grad_out.shape[-1])
        # The general code wherever it is needed: a graph for a second derivative, compiled autograd (exporting
        # is compiling), and below a subclass gradient, a dispatch mode, a torch.func transform, a tracer.
        if not (_grad_enabled() or _is_compiling()):
            saved, needs = ctx.saved_tensors, ctx.needs_input_grad
            # The plan's last backward's launches where its guard passes: every fact of the gradient and the
            # saved tensors is that backward's, under no mode, transform or tracer (as the forward's guard), in the
            # same epoch of the kernels' plans.
            fast = plan.fast
            if (fast is not None and fast[0] is _EPOCH.get(0) and fast[1] == needs
                    and fast[2].check(g, *saved[:fast[3]])):
                return plan.backward(fast[4], g, saved, _allow_tf32())
            if not (type(g) not in _PLAIN or _dispatch_modes() or _are_functorch_transforms_active()
                    or _is_tracing()):
                epoch = plan.epoch  # (launches looked up again after an override or an assumed device)
                if epoch is not _EPOCH.get(0) or epoch is None:
                    plan._bwd.clear()
                    epoch = plan.epoch = _epoch()
                steps = plan.backward_steps(g, saved, needs)
                if steps is not None:  # (None: a saved output in another layout)
                    if _Guards is not None:
                        k = len(saved) if plan.save_top else len(saved) - 1  # (the saved tensors, not the None)
                        plan.fast = (epoch, needs, _Guards(g, *saved[:k], dynamic_dims_sizes=None,
                                                           dynamic_dims_strides=None), k, steps)
                    return plan.backward(steps, g, saved, _allow_tf32())
        return _general_backward(ctx, plan, g)


def _general_backward(ctx, plan, g: Tensor) -> tuple:
    """:class:`_DirectChain`'s gradients by the general Functions' code (``_backward_triton``)."""
    from apex.ops.fused_dense import _backward_triton  # (which imports this module)

    saved, needs, n = ctx.saved_tensors, ctx.needs_input_grad, plan.n
    dx, dws, dbs = _backward_triton(g, saved[0], saved[1:1 + n], plan.has_bias, saved[1 + n:], plan.acts, needs[1],
                                    True in needs[2:], False)
    if dx is not None and plan.in_shape is not None:
        dx = dx.view(plan.in_shape)
    return None, dx, *dws, *(dbs if plan.has_bias else ())


_direct = super(torch.autograd.Function, _DirectChain).apply  # the C++ apply, as apex.ops._dispatch's
