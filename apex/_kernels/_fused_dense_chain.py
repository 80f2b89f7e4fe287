"""Whole-chain launch plans of ``apex.ops.fused_dense``'s eager path (its ``_lean``): every GEMM of one eager chain
call, its forward and its backward per gradient layout, derived once per key from the facts the key holds.

The launches are :mod:`apex._kernels.fused_dense`'s (its kernel, its per-shape GEMM plans and their
configurations), read through that module at each plan's making, so that what replaces them there (a test's
recording kernel, an emptied plan cache) is what a new plan takes.
"""

from __future__ import annotations

import torch

from apex._kernels import _tuning
from apex._kernels import fused_dense as _gemm
from apex._kernels._host import cdiv
from apex._kernels.fused_dense import GELU, NONE, bias_grad_alone

# The eager chains' plans (apex.ops.fused_dense's lean path), keyed there by every fact they derive from: the
# activation codes and, for the input, each weight and bias, its shape, dtype and device, and the strides of
# the input and weights. A plan_cache: emptied with the GEMM plans whose launchers it holds.
CHAINS = _tuning.plan_cache()
_stride = torch.Tensor.stride
_CHAINS_MAX = 1024  # distinct keys kept (a program whose batch size changes every call makes one each)
_BWD_MAX = 16  # backward layouts kept per chain (gradient strides, which inputs need a gradient)


def _step(m: int, n: int, k: int, dt: torch.dtype, strides: tuple, consts: tuple) -> tuple:
    """One GEMM of a chain: ``(kernel, (tail ieee, tail tf32), keywords)``, the tails being every argument
    after the seven pointers (what :func:`linear`, :func:`weight_grad` and :func:`input_grad` pass); the
    kernel None where the launch is skipped (an empty output, as there). The launch is
    ``kernel.run(*args, **keywords)``: what ``kernel[grid](*args, **options)`` calls, without its
    argument-forwarding frame (~0.5 µs a launch); ``run`` is looked up at each launch, as there."""
    if m == 0 or n == 0:
        return None, None, None
    _, ieee, tf32, options = _gemm._PLANS.get((m, n, k, dt)) or _gemm._plan(m, n, k, dt)
    head = (m, n, k, *strides, *consts)
    # (the plan's grid: its constexprs end with BM, BN, BK, GROUP_M)
    keywords = {"grid": (cdiv(m, ieee[2]) * cdiv(n, ieee[3]),), "warmup": False, **options}
    return _gemm._gemm_kernel, ((*head, *ieee), (*head, *tf32)), keywords


class ChainPlan:
    """Every launch of one eager chain call (its forward, and its backward per gradient layout), derived once
    from the key's facts: allocation sizes, grids, strides, constexprs. :meth:`forward` and :meth:`backward`
    allocate and launch what :func:`linear`, :func:`weight_grad` and :func:`input_grad` would, with the same
    arguments, reading no tensor attribute but the gradient's and the saved tensors' strides."""

    __slots__ = ("acts", "has_bias", "n", "rows", "dt", "on_gpu", "sizes", "in_shape", "out_shape", "fwd", "_bwd")

    def __init__(self, acts: tuple, has_bias: bool, x: torch.Tensor, weights):
        """The plan of a checked call: the chain's codes, whether it has biases, its input and weights."""
        n = len(acts)
        x_shape, dt = x.shape, x.dtype
        # The strides of x2, the input's rows as the forward takes them (reshape's view or copy: a function of
        # the input's shape and strides, which the key holds).
        x_stride = (x if len(x_shape) == 2 else x.reshape(-1, x_shape[-1])).stride()
        w_strides = [w.stride() for w in weights]
        sizes = [x_shape[-1], *[w.shape[0] for w in weights]]
        self.acts, self.has_bias, self.n, self.dt, self.sizes, self.on_gpu = acts, has_bias, n, dt, sizes, x.is_cuda
        self.in_shape = None if len(x_shape) == 2 else tuple(x_shape)
        rows = 1
        for d in x_shape[:-1]:
            rows *= d
        self.rows = rows
        self.out_shape = None if len(x_shape) == 2 else (*x_shape[:-1], sizes[-1])
        sa = x_stride  # the first layer reads x2, the others the previous layer's output ([rows, k], dense)
        steps = []
        for i in range(n):  # linear(a, w, bias, epi_act, pro_a): a GELU deferred into the next layer's load
            k, out = sizes[i], sizes[i + 1]
            sb1, sb0 = w_strides[i]
            act = acts[i]
            kernel, tails, keywords = _step(rows, out, k, dt, (*sa, sb0, sb1), (
                GELU if i and acts[i - 1] == GELU else NONE, NONE, False, NONE, has_bias,
                NONE if act == GELU else act, NONE, False))
            steps.append((out, i, n + i if has_bias else -1, kernel, tails, keywords))
            sa = (out, 1)
        self.fwd = tuple(steps)
        self._bwd: dict = {}

    def forward(self, x2: torch.Tensor, params: tuple, allow_tf32: bool) -> list:
        """``[x2, *weights, *outs]``: the input's rows ``x2``, the weights (``params``: the weights, then the
        biases) and every layer's output, launched on ``x2``, the last being the chain's. The list is what
        :meth:`backward` reads, in its order, once the top output is dropped where its activation has no
        derivative to take from it."""
        m = self.rows
        alloc = x2.new_empty
        a = x2
        saved = [x2, *params[:self.n]]
        for n, wi, bi, kernel, tails, keywords in self.fwd:
            c = alloc(m, n)
            if kernel is not None:
                kernel.run(a, params[wi], c, c if bi < 0 else params[bi], a, c, c, *tails[allow_tf32], **keywords)
            saved.append(c)
            a = c
        return saved

    def backward(self, g: torch.Tensor, saved: tuple, needs: tuple, allow_tf32: bool) -> tuple | None:
        """The gradients ``(None, dx, *dWᵢ, *dbᵢ)`` (the plan's, the input's, the parameters') from the output
        gradient's rows ``g``, what the forward saved (``(x2, *weights, *outs[:-1], top output or None)``) and
        which of those inputs need a gradient (``needs``, as ``ctx.needs_input_grad``). None where a saved
        output is not contiguous (a saved-tensor hook's copy may not be): the general launchers copy it."""
        n = self.n
        top = saved[-1]  # the top layer's output, where its activation's derivative needs it
        # The saved outputs are read at their dense strides (spelled out for one and two layers: a loop over a
        # slice costs ~1 µs more inside autograd's engine).
        if top is not None and not top.is_contiguous():
            return None
        if n == 2:
            if not saved[3].is_contiguous():
                return None
        elif n > 2:
            for t in saved[n + 1:2 * n]:
                if not t.is_contiguous():
                    return None
        x2 = saved[0]
        # The strides are read again: a saved tensor's can change after the forward (``param.data = …``).
        # (Spelled out for one and two layers: a map over a slice, unpacked, costs ~1 µs more.)
        if n == 1:
            key = (needs, g.stride(), x2.stride(), saved[1].stride())
        elif n == 2:
            key = (needs, g.stride(), x2.stride(), saved[1].stride(), saved[2].stride())
        else:
            key = (needs, g.stride(), x2.stride(), *map(_stride, saved[1:n + 1]))
        steps = self._bwd.get(key) or self._backward_steps(key)
        grads = [None] * (2 + 2 * n if self.has_bias else 2 + n)
        alloc = g.new_empty  # every gradient has the output gradient's dtype and device
        # The pointer the kernel reads the activation derivative's operand from (the gradient's where none).
        aux = g if top is None else top
        for i, b, wg, ig in steps:  # the top layer first
            # b: the index in saved of the layer's input (the previous layer's stored output, or x2)
            if wg is not None:
                rows, cols, kernel, tails, keywords = wg
                c = grads[2 + i] = alloc(rows, cols)
                db = c
                if self.has_bias:
                    db = grads[2 + n + i] = alloc(rows)
                if kernel is not None:
                    kernel.run(g, saved[b], c, c, aux, c, db, *tails[allow_tf32], **keywords)
                elif self.has_bias and cols == 0:
                    bias_grad_alone(g, self.acts[-1] if i == n - 1 else NONE, aux, db)
            if ig is not None:
                rows, cols, kernel, tails, keywords, dact_c = ig
                c = alloc(rows, cols)
                if kernel is not None:
                    kernel.run(g, saved[1 + i], c, c, aux, saved[b] if dact_c else c, c, *tails[allow_tf32],
                               **keywords)
                if i:
                    g = aux = c
                else:
                    grads[1] = c if self.in_shape is None else c.view(self.in_shape)
        return tuple(grads)

    def _backward_steps(self, key: tuple) -> tuple:
        """The backward's launches for a key of :meth:`backward`, as ``_backward_triton`` makes them: per layer,
        top first, ``(i, where the layer's input is in saved, weight-gradient step, input-gradient step)``, a
        step None where not needed: ``(rows, cols, kernel, tails, keywords)`` (plus, for the input gradient,
        whether its epilogue applies the previous layer's activation derivative)."""
        needs, sg, sx = key[:3]
        # (as chain_grads: every parameter's gradient where any parameter needs one)
        need_dx, need_w = needs[1], True in needs[2:]
        acts, n, rows, dt, sizes = self.acts, self.n, self.rows, self.dt, self.sizes
        dact = acts[-1]
        steps = []
        for i in range(n - 1, -1, -1):
            k, out = sizes[i], sizes[i + 1]
            sb = sx if i == 0 else (k, 1)
            wg = ig = None
            if need_w:  # weight_grad(g, b, dact, aux, pro_b, db): g given as [out, rows] (trans_a)
                pro_b = GELU if i and acts[i - 1] == GELU else NONE
                wg = (out, k, *_step(out, k, rows, dt, (sg[1], sg[0], *sb),
                                     (NONE, dact, dact != NONE, pro_b, False, NONE, NONE, self.has_bias)))
            if i or need_dx:  # input_grad(g, w, dact, aux, dact_c, aux_c)
                dact_c = acts[i - 1] if i else NONE
                ig = (rows, k, *_step(rows, k, out, dt, (*sg, *key[3 + i]),
                                      (NONE, dact, False, NONE, False, NONE, dact_c, False)), dact_c != NONE)
            steps.append((i, n + i if i else 0, wg, ig))
            sg, dact = (k, 1), NONE
        if len(self._bwd) >= _BWD_MAX:
            self._bwd.clear()
        steps = self._bwd[key] = tuple(steps)
        return steps


def keep_chain(key: tuple, plan: ChainPlan | bool) -> ChainPlan | bool:
    """``plan`` kept in :data:`CHAINS` under ``key`` (built by the caller from every fact it derives from)."""
    if len(CHAINS) >= _CHAINS_MAX:
        CHAINS.clear()
    CHAINS[key] = plan
    return plan
