"""Whole-chain launch plans of the dense chains' lean eager path (:mod:`apex.ops._dense_direct`): every GEMM of
one eager chain call, its forward and its backward per gradient layout, derived once per key from the facts the
key holds.

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

# The eager chains' plans (apex.ops._dense_direct's), keyed there by every fact they derive from: the activation
# codes and, for the input, each weight and bias, its shape, layout, dtype and device. A plan_cache: emptied with
# the GEMM plans whose launchers it holds.
CHAINS = _tuning.plan_cache()
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
    arguments, reading no tensor attribute but the gradient's and the saved tensors' layouts. A contiguous
    tensor is launched at the strides its shape implies (one with a size-1 dim may hold any stride along it,
    which addresses nothing there: the same elements, the same bits). ``epoch``: its maker's token of the
    kernels' plans, which ``_bwd`` (the backward's launches, per gradient layout) were derived under."""

    __slots__ = ("acts", "has_bias", "n", "rows", "dt", "on_gpu", "sizes", "in_shape", "out_shape", "fwd", "_bwd",
                 "save_top", "epoch", "fwd_layouts", "fast")

    def __init__(self, acts: tuple, has_bias: bool, x: torch.Tensor, weights):
        """The plan of a checked call: the chain's codes, whether it has biases, its input and weights."""
        n = len(acts)
        x_shape, dt = x.shape, x.dtype
        # The strides of x2, the input's rows as the forward takes them (reshape's view or copy: a function of
        # the input's shape and strides, which the key holds).
        x2 = x if len(x_shape) == 2 else x.reshape(-1, x_shape[-1])
        # The layouts of x2 and the weights (True: contiguous), as the backward reads them from its saved tensors.
        self.fwd_layouts = (x2.is_contiguous() or x2.stride(), *[w.is_contiguous() or w.stride() for w in weights])
        x_stride = (x_shape[-1], 1) if x2.is_contiguous() else x2.stride()
        w_strides = [(w.shape[1], 1) if w.is_contiguous() else w.stride() for w in weights]
        sizes = [x_shape[-1], *[w.shape[0] for w in weights]]
        self.acts, self.has_bias, self.n, self.dt, self.sizes, self.on_gpu = acts, has_bias, n, dt, sizes, x.is_cuda
        self.save_top = acts[-1] != NONE  # (the top output is saved only where its derivative reads it)
        self.epoch = self.fast = None  # (its maker's: apex.ops._dense_direct)
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

    def forward(self, x: torch.Tensor, params: tuple, allow_tf32: bool, save=None) -> torch.Tensor:
        """The chain's output on input ``x`` (``params``: the weights, then the biases), of ``x``'s leading
        dims. ``save``: where given (a context's ``save_for_backward``), what :meth:`backward_steps` and
        :meth:`backward` read is passed to it: ``(x2, *weights, *outs[:-1], top output or None)``, ``x2`` being
        the input's rows and ``outs`` every layer's output, the top one only where its activation's derivative is
        taken from it. (One and two layers spelled out: no loop, no list.)"""
        x2 = x if self.in_shape is None else x.reshape(-1, x.shape[-1])
        m = self.rows
        alloc = x2.new_empty
        n = self.n
        if n <= 2:
            w = params[0]
            cols, _, bi, kernel, tails, keywords = self.fwd[0]
            c = alloc(m, cols)
            if kernel is not None:
                kernel.run(x2, w, c, c if bi < 0 else params[bi], x2, c, c, *tails[allow_tf32], **keywords)
            if n == 1:
                if save is not None:
                    save(x2, w, c if self.save_top else None)
            else:
                a, v = c, params[1]
                cols, _, bi, kernel, tails, keywords = self.fwd[1]
                c = alloc(m, cols)
                if kernel is not None:
                    kernel.run(a, v, c, c if bi < 0 else params[bi], a, c, c, *tails[allow_tf32], **keywords)
                if save is not None:
                    save(x2, w, v, a, c if self.save_top else None)
        else:
            a = x2
            outs = []
            for cols, wi, bi, kernel, tails, keywords in self.fwd:
                c = alloc(m, cols)
                if kernel is not None:
                    kernel.run(a, params[wi], c, c if bi < 0 else params[bi], a, c, c, *tails[allow_tf32],
                               **keywords)
                outs.append(c)
                a = c
            if save is not None:
                if not self.save_top:
                    outs[-1] = None
                save(x2, *params[:n], *outs)
        return c if self.out_shape is None else c.view(self.out_shape)

    def backward_steps(self, g: torch.Tensor, saved: tuple, needs: tuple) -> tuple | None:
        """The backward's launches for the output gradient's rows ``g``, what :meth:`forward` saved and which of
        its inputs need a gradient (``needs``, as ``ctx.needs_input_grad``); None where a saved output is not
        contiguous (a saved-tensor hook's copy may not be): the general launchers copy it."""
        n = self.n
        top = saved[-1]  # the top layer's output, where its activation's derivative needs it
        if top is not None and not top.is_contiguous():
            return None
        x2 = saved[0]
        # Every layout is read again: a saved tensor's can change after the forward (``param.data = …``, a
        # saved-tensor hook). A layout is True for a contiguous tensor (its strides implied), else its strides;
        # where every one is the forward's and the gradient is contiguous (the usual backward) the launches are
        # kept per ``needs`` alone, else per ``(needs, layouts)``.
        if n == 1:
            layouts = (x2.is_contiguous() or x2.stride(), saved[1].is_contiguous() or saved[1].stride())
        elif n == 2:
            if not saved[3].is_contiguous():
                return None
            w, v = saved[1], saved[2]
            layouts = (x2.is_contiguous() or x2.stride(), w.is_contiguous() or w.stride(),
                       v.is_contiguous() or v.stride())
        else:
            for t in saved[n + 1:2 * n]:
                if not t.is_contiguous():
                    return None
            layouts = (x2.is_contiguous() or x2.stride(), *[w.is_contiguous() or w.stride() for w in saved[1:n + 1]])
        sg = g.is_contiguous() or g.stride()
        key = needs if sg is True and layouts == self.fwd_layouts else (needs, sg, *layouts)
        return self._bwd.get(key) or self._backward_steps(key)

    def backward(self, steps: tuple, g: torch.Tensor, saved: tuple, allow_tf32: bool) -> tuple:
        """The gradients ``(None, dx, *dWᵢ, *dbᵢ)`` (the plan's, the input's, the parameters') from the output
        gradient's rows ``g`` (the output's dtype) and what :meth:`forward` saved, launching ``steps`` (what
        :meth:`backward_steps` answered for them)."""
        n = self.n
        top = saved[-1]
        alloc = g.new_empty  # every gradient has the output gradient's dtype and device
        # The pointer the kernel reads the activation derivative's operand from (the gradient's where none).
        aux = g if top is None else top
        if n <= 2:  # (spelled out, no loop and no call but the launches': ~10 µs less inside autograd's engine)
            has_bias = self.has_bias
            ws = wb = None
            if n == 2:
                (_, _, wg, ig), (_, _, wg0, ig0) = steps
                out0 = saved[3]
                if wg is not None:  # the top layer's weight gradient, on the lower layer's output
                    rows, cols, kernel, tails, keywords = wg
                    ws = alloc(rows, cols)
                    wb = alloc(rows) if has_bias else None
                    if kernel is not None:
                        kernel.run(g, out0, ws, ws, aux, ws, ws if wb is None else wb, *tails[allow_tf32],
                                   **keywords)
                    elif wb is not None and cols == 0:
                        bias_grad_alone(g, self.acts[-1], aux, wb)
                rows, cols, kernel, tails, keywords, dact_c = ig  # (always: the lower layer's gradient)
                c = alloc(rows, cols)
                if kernel is not None:
                    kernel.run(g, saved[2], c, c, aux, out0 if dact_c else c, c, *tails[allow_tf32], **keywords)
                g = aux = c
                wg, ig = wg0, ig0
            else:
                (_, _, wg, ig), = steps
            dw = db = dx = None
            if wg is not None:
                rows, cols, kernel, tails, keywords = wg
                dw = alloc(rows, cols)
                db = alloc(rows) if has_bias else None
                if kernel is not None:
                    kernel.run(g, saved[0], dw, dw, aux, dw, dw if db is None else db, *tails[allow_tf32], **keywords)
                elif db is not None and cols == 0:
                    bias_grad_alone(g, self.acts[-1] if n == 1 else NONE, aux, db)
            if ig is not None:
                rows, cols, kernel, tails, keywords, _ = ig
                dx = alloc(rows, cols)
                if kernel is not None:
                    kernel.run(g, saved[1], dx, dx, aux, dx, dx, *tails[allow_tf32], **keywords)
                if self.in_shape is not None:
                    dx = dx.view(self.in_shape)
            if n == 1:
                return (None, dx, dw, db) if has_bias else (None, dx, dw)
            return (None, dx, dw, ws, db, wb) if has_bias else (None, dx, dw, ws)
        grads = [None] * (2 + 2 * n if self.has_bias else 2 + n)
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
        full = key if type(key[0]) is tuple else (key, True, *self.fwd_layouts)  # (needs alone: backward_steps)
        needs, sg, sx = full[:3]
        # (as chain_grads: every parameter's gradient where any parameter needs one)
        need_dx, need_w = needs[1], True in needs[2:]
        acts, n, rows, dt, sizes = self.acts, self.n, self.rows, self.dt, self.sizes
        # A contiguous tensor's implied strides (as the forward's): g [rows, out], x2 [rows, in], Wᵢ [outᵢ, inᵢ].
        sg = (sizes[-1], 1) if sg is True else sg
        sx = (sizes[0], 1) if sx is True else sx
        dact = acts[-1]
        steps = []
        for i in range(n - 1, -1, -1):
            k, out = sizes[i], sizes[i + 1]
            sb = sx if i == 0 else (k, 1)
            sw = (k, 1) if full[3 + i] is True else full[3 + i]
            wg = ig = None
            if need_w:  # weight_grad(g, b, dact, aux, pro_b, db): g given as [out, rows] (trans_a)
                pro_b = GELU if i and acts[i - 1] == GELU else NONE
                wg = (out, k, *_step(out, k, rows, dt, (sg[1], sg[0], *sb),
                                     (NONE, dact, dact != NONE, pro_b, False, NONE, NONE, self.has_bias)))
            if i or need_dx:  # input_grad(g, w, dact, aux, dact_c, aux_c)
                dact_c = acts[i - 1] if i else NONE
                ig = (rows, k, *_step(rows, k, out, dt, (*sg, *sw),
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
