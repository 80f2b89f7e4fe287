"""The lean eager paths of the transducer joint and loss on the Triton path (a dense joint output, dense
logits): a plan per argument layout and one plain ``autograd.Function`` each that allocates and launches from
it.

Everything the usual dense call derives besides its tensors and its values follows from a few facts of its
arguments: whether the usual call's checks pass (``_usual_dense`` of :mod:`apex.ops.transducer_joint` and of
:mod:`apex.ops.transducer_loss`: ranks, shapes, dtypes and devices), which tensors need a contiguous or an
int32 copy, and the launch plans of the kernels (by sizes alone). :class:`JointLean` and :class:`LossLean` keep
a plan per key of every one of those facts (shape, strides or contiguity, dtype and device of each tensor; the
joint's options). A hit stands for those checks and launches what ``forward_dense``/``backward_dense``
(``grad_dense``) launch, with the same arguments (the same bits). A miss is planned only where the usual call's
checks pass; else the key is kept as False and the general path takes the call (its checks, its errors).

The VALUES of the lengths and labels are never read on the host here, and need not be: on this path the
general call does not read them either (its kernels check them: an entry out of range gets NaN, a zero mask and
a zero gradient), so a plan, which covers metadata only, drops no check.

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers, the backend, whether a gradient is needed, the joint's options (exact
bools and int; a float or int dropout probability), the loss's ``opt`` and ``blank_idx`` (an int in range),
and the loss's ``debug_list``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex.ops._checks import member_set
from apex.ops._dispatch import _PLAIN
from apex.ops._lean import PlanTable
from apex.ops._lean import guarded as _guarded
from apex.ops._lean import refresh_guard as _refresh_guard
from apex.ops._lean import triton_takes as _triton_takes
from apex.ops._norm import _same_device

Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_I32 = torch.int32
_FLOATS = member_set(torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INTS = member_set(torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)
_OPTS = (-1, 0, 1)  # (transducer_loss._check_opt's values)


def _lens(t: Tensor) -> Tensor:
    # As the general path converts lengths for the kernels (_usual_dense's expression).
    return (t if t.dtype is _I32 else t.to(_I32)).contiguous()


def _key(t: Tensor) -> tuple:
    # A contiguous tensor's strides are implied by its shape: is_contiguous() costs less than stride().
    return t.shape, t.is_contiguous() or t.stride(), t.dtype, t.device


# ------------------------------------------------------------------------------------------------- joint
class JointPlan:
    """One dense joint layout's launches. ``relu``, ``dropout``, ``p`` (the dropout probability as a float,
    0.0 without dropout), ``tile``: the options it was planned for; ``fc``/``gc``: f/g need no copy;
    ``fl``/``gl``: the lengths are the kernels' int32 already; ``fwd``: ``(launch, head, tail)`` of the
    forward (``launch(f, g, f_len, g_len, f_len, h, mask, *head, seed, *tail)``); ``bwd_f``/``bwd_g``: the
    backward's two launches and their tails; ``scale``: the backward's dropout scale."""

    __slots__ = ("key", "relu", "dropout", "p", "tile", "fc", "gc", "fl", "gl", "dims", "masked", "fwd",
                 "bwd_f", "bwd_g", "fdims", "gdims", "scale", "guards", "guard_builds")

    def __init__(self, key: tuple, f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, relu: bool, dropout: bool,
                 p: float, tile: int, kernels):
        self.key, self.relu, self.dropout, self.p, self.tile = key, relu, dropout, p, tile
        self.guards, self.guard_builds = [], 0
        self.fc, self.gc = key[1] is True, key[5] is True
        self.fl = f_len.dtype is _I32 and f_len.is_contiguous()
        self.gl = g_len.dtype is _I32 and g_len.is_contiguous()
        B, T, H = f.shape
        U = g.shape[1]
        self.dims, self.fdims, self.gdims = (B, T, U, H), (B, T, H), (B, U, H)
        self.masked = relu or dropout
        bh = kernels._block_h(H)
        cdiv = kernels.cdiv
        # (forward_dense's and backward_dense's grids and arguments: the constexprs positionally)
        self.fwd = (kernels._joint_fwd[(B * T, cdiv(U, tile), cdiv(H, bh))], (T, U, H, 1.0 - p),
                    (False, relu, dropout, tile, bh))
        self.scale = 1.0 / (1.0 - p) if dropout else 1.0
        self.bwd_f = (kernels._joint_bwd[(B * T, cdiv(H, bh))], (T, U, H, self.scale, False, self.masked, True, bh))
        self.bwd_g = (kernels._joint_bwd[(B * U, cdiv(H, bh))], (T, U, H, self.scale, False, self.masked, False, bh))

    def forward(self, f: Tensor, g: Tensor, fl: Tensor, gl: Tensor, probe: list | None) -> tuple:
        """``(h, mask or None)``, the mask appended to ``probe`` (as the general path)."""
        # The seed drawn as the general path draws it (the same random stream).
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if self.dropout else 0
        h = f.new_empty(*self.dims)
        mask = f.new_zeros(*self.dims, dtype=torch.uint8) if self.masked else None
        launch, head, tail = self.fwd
        launch(f if self.fc else f.contiguous(), g if self.gc else g.contiguous(), fl, gl, fl, h,
               h if mask is None else mask, *head, seed, *tail)
        if mask is not None and probe is not None:
            probe.append(mask)
        return h, mask


def _joint_forward(ctx, f, g, args):
    plan, fl, gl, probe = args
    h, mask = plan.forward(f, g, fl, gl, probe)
    # The lengths as the kernels read them (as the general Function saves them: an in-place change of an int32
    # length between the forward and the backward is autograd's error, as before).
    ctx.save_for_backward(mask, fl, gl)
    ctx.plan = plan
    return h


def _joint_backward(ctx, dh):
    mask, fl, gl = ctx.saved_tensors
    plan = ctx.plan
    dh = dh.contiguous()  # (the mask as the forward's kernel wrote it: contiguous)
    df, dg = dh.new_empty(*plan.fdims), dh.new_empty(*plan.gdims)
    # (a saved-tensor hook may give the mask back in another layout: the kernels read it contiguous)
    m = dh if mask is None else mask if mask.is_contiguous() else mask.contiguous()
    launch, tail = plan.bwd_f
    launch(dh, m, fl, gl, fl, df, dg, *tail)
    launch, tail = plan.bwd_g
    launch(dh, m, fl, gl, fl, df, dg, *tail)
    return df, dg, None


# Named as the general Function, so that its graph nodes read TransducerJointFuncBackward as before.
_DirectJoint = type("TransducerJointFunc", (torch.autograd.Function,), {
    "__module__": __name__, "__qualname__": "_DirectJoint",
    "forward": staticmethod(_joint_forward), "backward": staticmethod(_joint_backward)})
_joint_direct = super(torch.autograd.Function, _DirectJoint).apply  # the C++ apply


class JointLean:
    """The joint's plans and its eager entry: :meth:`run` answers ``h``, or None where the general path must
    take the call (having changed nothing). ``kernels``: the kernel module's getter."""

    def __init__(self, kernels: Callable):
        self.kernels = kernels
        self.table = PlanTable()

    def run(self, f: object, g: object, f_len: object, g_len: object, relu: object, dropout: object,
            dropout_prob: object, tile: object, probe: list | None) -> Tensor | None:
        """A dense joint (``pack_output=False``; the caller decides) with these options."""
        # First, before any lookup: what torch.compile, torch.export (which compiles), a dispatch mode, a
        # torch.func transform or a tracer sees is the general path (nothing planned under them), as is a
        # subclass or not a tensor (its errors); then the backend's answer.
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(f) not in _PLAIN or not _triton_takes(f.is_cuda, f)):
            return None
        if dropout is True:  # (the probability matters only with dropout; an int one is the float it equals)
            p = dropout_prob
            if type(p) is not float:
                if type(p) is not int:
                    return None
                p = float(p)
        else:
            p = 0.0
        ts = (f, g, f_len, g_len)
        plan = self.table.last.get(0)
        # The last call's plan where this call has its options and its tensors pass the plan's guard (see
        # apex.ops._lean.refresh_guard: types, dtypes, devices, sizes, strides), else the plan of the call's key.
        # (`is`: exact bools and int, as the key holds them)
        if plan is None or not (relu is plan.relu and dropout is plan.dropout and tile is plan.tile
                                and p == plan.p and _guarded(plan, ts)):
            if (type(g) not in _PLAIN or type(f_len) not in _PLAIN or type(g_len) not in _PLAIN
                    or type(relu) is not bool or type(dropout) is not bool or type(tile) is not int):
                return None
            key = (*_key(f), *_key(g), *_key(f_len), *_key(g_len), relu, dropout, p, tile)
            plan = self.table.get(key)
            if plan is None:
                plan = self.table.keep(key, self._plan(key, f, g, f_len, g_len, relu, dropout, p, tile))
            if not plan:
                return None
            _refresh_guard(plan, ts)
        fl = f_len if plan.fl else _lens(f_len)
        gl = g_len if plan.gl else _lens(g_len)
        if _grad_enabled() and (f.requires_grad or g.requires_grad):
            return _joint_direct(f, g, (plan, fl, gl, probe))
        return plan.forward(f, g, fl, gl, probe)[0]

    def _plan(self, key, f, g, f_len, g_len, relu, dropout, p, tile) -> JointPlan | bool:
        """The plan of a key not seen yet, or False where the usual dense call's checks (the general
        ``_usual_dense``'s, exactly) do not pass: the general path takes such calls."""
        fs, gs, ls = f.shape, g.shape, f_len.shape
        if not (tile in (1, 2, 4) and 0.0 <= p < 1.0 and len(fs) == 3 and len(gs) == 3 and len(ls) == 1
                and gs[0] == ls[0] == fs[0] > 0 and gs[2] == fs[2] and g_len.shape == ls):
            return False
        dtype = f.dtype
        if not (dtype in _FLOATS and g.dtype is dtype and f_len.dtype in _INTS and g_len.dtype in _INTS
                and f_len.get_device() == g_len.get_device() and _same_device(g, f) and _same_device(f_len, f)):
            return False
        return JointPlan(key, f, g, f_len, g_len, relu, dropout, p, tile, self.kernels())


# -------------------------------------------------------------------------------------------------- loss
class LossPlan:
    """One dense-logits layout's launches. ``xc``: the logits need no copy; ``lab``, ``fl``, ``yl``: the
    labels are contiguous, the lengths the kernels' int32 already; ``btu``: (B, T, U); ``acc``: the lattices'
    dtype where it is not the logits' own (None); ``lse``/``ab``: the forward's launches and their arguments
    (``ab``'s head before ``blank_idx``, tail after); ``grad``: the fused backward's; ``V``: the vocabulary."""

    __slots__ = ("key", "xc", "lab", "fl", "yl", "btu", "B", "V", "acc", "lse", "ab", "grad", "gdims", "general",
                 "guards", "guard_builds")

    def __init__(self, key: tuple, x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, kernels,
                 general: Callable):
        self.key, self.general, self.guards, self.guard_builds = key, general, [], 0
        self.xc, self.lab = key[1] is True, key[5] is True
        self.fl = f_len.dtype is _I32 and f_len.is_contiguous()
        self.yl = y_len.dtype is _I32 and y_len.is_contiguous()
        B, T, U, V = x.shape
        L = label.shape[1]
        dtype = x.dtype
        self.btu, self.B, self.V, self.gdims = (B, T, U), B, V, (B, T, U, V)
        self.acc = None if dtype is torch.float32 or dtype is torch.float64 else torch.float32
        # (forward_dense's and grad_dense's plans, grids and arguments: the constexprs positionally)
        rows = B * T * U
        grid, per, bv = kernels._row_plan(rows, V)
        self.lse = (kernels._row_lse[grid], (rows, V, per, bv))
        self.grad = (kernels._grad[grid], (rows, T, U, T, U, V, L), (False, True, per, bv))
        plan = kernels._LATTICE_PLANS.get((B, U))
        grid, bb, block_u = plan if plan is not None else kernels._lattice_plan(B, U)
        self.ab = (kernels._alpha_beta[grid], (B, T, U, T, U, V, L, L), (False, bb, block_u))

    def forward(self, x: Tensor, lab: Tensor, fl: Tensor, yl: Tensor, blank: int) -> tuple:
        """``(loss, lse, alpha, beta)``: forward_dense's."""
        xc = x if self.xc else x.contiguous()
        acc = self.acc
        if acc is None:
            lse, alpha, beta = xc.new_empty(*self.btu), xc.new_empty(*self.btu), xc.new_empty(*self.btu)
        else:
            lse = xc.new_empty(*self.btu, dtype=acc)
            alpha, beta = xc.new_empty(*self.btu, dtype=acc), xc.new_empty(*self.btu, dtype=acc)
        loss = xc.new_empty(self.B)
        launch, args = self.lse
        launch(xc, lse, *args)
        launch, head, tail = self.ab
        launch(xc, lse, lab, fl, yl, fl, alpha, beta, loss, *head, blank, *tail)
        return loss, lse, alpha, beta


def _loss_forward(ctx, x, args):
    plan, lab, fl, yl, blank, fused, debug_list = args
    loss, lse, alpha, beta = plan.forward(x, lab, fl, yl, blank)
    if debug_list is not None and debug_list == []:
        debug_list += (alpha, beta)  # (as the general path extends it)
    # The labels and lengths as the kernels read them, as the general Function saves them.
    ctx.save_for_backward(x, lse, alpha, beta, fl, yl, lab)
    ctx.args = (plan, blank, fused)
    return loss


def _loss_backward(ctx, loss_grad):
    x, lse, alpha, beta, fl, yl, lab = ctx.saved_tensors
    plan, blank, fused = ctx.args
    if not fused:  # the general Function's unfused gradient (the log-softmax backward in PyTorch)
        return plan.general(x, loss_grad, lse, alpha, beta, lab, fl, yl, None, blank, fused, False), None
    x = x.contiguous()
    if not (lse.is_contiguous() and alpha.is_contiguous() and beta.is_contiguous() and lab.is_contiguous()):
        # (as the joint's mask)
        lse, alpha, beta, lab = lse.contiguous(), alpha.contiguous(), beta.contiguous(), lab.contiguous()
    out = x.new_empty(*plan.gdims)
    launch, head, tail = plan.grad
    launch(x, lse, lab, fl, yl, fl, fl, alpha, beta, loss_grad.contiguous(), out, *head, blank, *tail)
    return out, None


# Named as the general Function, so that its graph nodes read TransducerLossFuncBackward as before.
_DirectLoss = type("TransducerLossFunc", (torch.autograd.Function,), {
    "__module__": __name__, "__qualname__": "_DirectLoss",
    "forward": staticmethod(_loss_forward), "backward": staticmethod(_loss_backward)})
_loss_direct = super(torch.autograd.Function, _DirectLoss).apply  # the C++ apply


class LossLean:
    """The loss's plans and its eager entry: :meth:`run` answers the losses, or None where the general path
    must take the call (having changed nothing). ``kernels``: the kernel module's getter; ``general``: the
    general unfused gradient (``apex.ops.transducer_loss.gradient``)."""

    def __init__(self, kernels: Callable, general: Callable):
        self.kernels, self.general = kernels, general
        self.table = PlanTable()

    def run(self, x: object, label: object, f_len: object, y_len: object, blank_idx: object, fused: object,
            debug_list: object, opt: object) -> Tensor | None:
        """Dense logits (``packed_input=False``; the caller decides)."""
        if opt != 1 and opt not in _OPTS:  # (the general path raises _check_opt's error)
            return None
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(x) not in _PLAIN or not _triton_takes(x.is_cuda, x)):  # (as the joint's)
            return None
        ts = (x, label, f_len, y_len)
        plan = self.table.last.get(0)
        # The last call's plan where this call's tensors pass the plan's guard (see apex.ops._lean.refresh_guard:
        # types, dtypes, devices, sizes, strides), else the plan of the call's key.
        if plan is None or not _guarded(plan, ts):
            if type(label) not in _PLAIN or type(f_len) not in _PLAIN or type(y_len) not in _PLAIN:
                return None
            key = (*_key(x), *_key(label), *_key(f_len), *_key(y_len))
            plan = self.table.get(key)
            if plan is None:
                plan = self.table.keep(key, self._plan(key, x, label, f_len, y_len))
            if not plan:
                return None
            _refresh_guard(plan, ts)
        # blank_idx is the call's (not planned): an int in [0, V), else the general path and its error.
        if type(blank_idx) is not int or not 0 <= blank_idx < plan.V:
            return None
        lab = label if plan.lab else label.contiguous()
        fl = f_len if plan.fl else _lens(f_len)
        yl = y_len if plan.yl else _lens(y_len)
        if _grad_enabled() and x.requires_grad:
            return _loss_direct(x, (plan, lab, fl, yl, blank_idx, fused, debug_list))
        loss, _, alpha, beta = plan.forward(x, lab, fl, yl, blank_idx)
        if debug_list is not None and debug_list == []:
            debug_list += (alpha, beta)  # (as the general path extends it)
        return loss

    def _plan(self, key, x, label, f_len, y_len) -> LossPlan | bool:
        """The plan of a key not seen yet, or False where the usual dense call's checks (the general
        ``_usual_dense``'s, exactly; ``blank_idx``'s range is the call's) do not pass."""
        shape, ls, fs = x.shape, label.shape, f_len.shape
        if not (len(shape) == 4 and len(ls) == 2 and len(fs) == 1 and ls[0] == fs[0] == shape[0] > 0
                and y_len.shape == fs and shape[3] > 0):
            return False
        if not (x.dtype in _FLOATS and label.dtype in _INTS and f_len.dtype in _INTS and y_len.dtype in _INTS):
            return False
        where = x.get_device()
        if label.get_device() != where or f_len.get_device() != where or y_len.get_device() != where:
            return False
        return LossPlan(key, x, label, f_len, y_len, self.kernels(), self.general)
