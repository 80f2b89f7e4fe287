"""The lean eager path of OpenFold's LayerNorm (``LayerNormSmallShapeOptImpl.apply``) on the Triton path: a plan
per argument layout and one plain ``autograd.Function`` that allocates and launches from it.

Everything such a call derives besides its tensors follows from a few facts of its arguments: whether
``check_args`` passes (it reads the input's shape, dtype and device, ``normalized_shape``, each parameter's shape
and device), whether the kernels take it (``use_kernel``: the input's dtype, the row length), the rows the kernels
read (``_kernel_view``: the input in place, or a 2-D view of a contiguous one), the parameters as the kernels read
them (``_flat``: as given, or a 1-D view of a contiguous one), the input's strides (the kernels' geometry) and the
launches' keys (the parameters' dtypes). :class:`Lean` keeps an :class:`LNPlan` per key of every one of those
facts (the input's shape, strides (True where contiguous), dtype and device; ``normalized_shape`` exactly; each
parameter's shape, dtype, device and contiguity): a hit stands for the checks and launches through the kernels'
own plans (``apex._kernels.openfold_layer_norm.fwd_plan``/``bwd_plan``, whose ``launch`` the general launchers call
too, with the same arguments: the same bits, and the config the autotuner's cache holds at each launch). A miss
is checked first (the general path's errors, in its order) and planned only where the kernels run the call as a
plan does: the kernels' dtypes, a row that fits them, not empty, rows and parameters that are the tensors given or
views of them (the general path copies others). A key that is not planned is kept as False.

The parameters' facts are read at every call: ``param.data = ...`` changes a parameter's dtype, device, shape or
layout without changing the parameter. ``eps`` is no fact of a plan (passed on), but must be a float (the general
path converts anything else).

Asked at every call, not planned: tensor subclasses, ``torch.compile``/``torch.export``, dispatch modes,
``torch.func`` transforms and tracers (the Function, as before), the backend and whether a gradient is needed. The
backward takes the general backward (the Function's: ``backward_checked``) wherever the plan's launches would not
be what it launches: a graph for a second derivative, a subclass gradient, compiling, a dispatch mode, a
``torch.func`` transform, a tracer, and saved tensors a saved-tensor hook gave back in another layout.

Visible difference: the output's ``grad_fn`` is ``_DirectOpenFoldLayerNormBackward`` (the general path's:
``LayerNormSmallShapeOptImplBackward``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C import _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex.ops._checks import member_set
from apex.ops._lean import EPOCH as _EPOCH
from apex.ops._lean import PlanTable
from apex.ops._lean import epoch as _epoch
from apex.ops._lean import exact_shape as _exact_shape
from apex.ops._lean import triton_takes as _triton_takes

Tensor = torch.Tensor
_PLAIN = member_set(torch.Tensor, torch.nn.Parameter)
_PLAIN_OR_NONE = member_set(torch.Tensor, torch.nn.Parameter, type(None))
_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_F32 = torch.float32
_CONTIG = torch.contiguous_format
_UNSEEN = object()


class LNPlan:
    """One argument layout's launches. ``sx``: the input's strides, or True where contiguous (the backward
    compares its saved input's with them); ``view``: the kernels read a ``[m, n]`` view of the (contiguous) input,
    else the input itself; ``pview``: they read 1-D views of the (contiguous, multi-dim) parameters; ``plain``:
    neither; ``size``: where not None, the output's (and ``dx``'s) sizes for ``new_empty``; ``geo``: the rows'
    geometry (``_geometry``'s: a contiguous input's strides along size-1 dims, which address nothing, are the first
    call's); ``fwd``: the kernels' forward plan; ``bwd``: per ``(need dw, need db)``, the backward's with the
    :data:`_EPOCH` it was looked up in (looked up again after an override or an assumed device, as the general
    launcher would); ``f32``: an fp32 input; ``wdt``, ``bdt``: the gradients' dtypes; ``shape``: the checked
    ``normalized_shape``."""

    __slots__ = ("key", "on_gpu", "sx", "view", "pview", "plain", "size", "m", "n", "geo", "fwd", "bwd", "f32", "wdt",
                 "bdt", "shape", "lean")

    def __init__(self, key: tuple, x: Tensor, xv: Tensor, shape: tuple, m: int, n: int, weight, bias, lean):
        self.key, self.on_gpu, self.sx, self.shape, self.lean = key, x.is_cuda, key[1], shape, lean
        self.view, self.pview, self.m, self.n = xv is not x, len(shape) != 1, m, n
        self.plain = not (self.view or self.pview)
        # The sizes whose new_empty is _contiguous_like(x) (empty_like, contiguous), for less: all but a contiguous
        # input with a size-1 dim, whose stride there empty_like keeps (then empty_like itself).
        self.size = None if key[1] is True and 1 in x.shape else tuple(x.shape)
        kernels = lean.kernels()
        self.geo = kernels._geometry(xv)
        self.wdt = (weight if weight is not None else x).dtype
        self.bdt = (bias if bias is not None else x).dtype
        self.fwd = kernels.fwd_plan((False, m, n, weight is not None, bias is not None, x.dtype, self.wdt, self.bdt))
        self.bwd = [(None, None)] * 4
        self.f32 = x.dtype is _F32

    def run(self, x: Tensor, weight, bias, eps: float) -> tuple:
        """``forward_checked``'s views, allocations (``y`` as ``_contiguous_like`` makes it) and launch:
        ``(y, mean, rstd)``."""
        m = self.m
        xv = x.view(m, self.n) if self.view else x
        y = torch.empty_like(xv) if self.sx is True else torch.empty_like(xv, memory_format=_CONTIG)
        mean = x.new_empty(m) if self.f32 else torch.empty(m, dtype=_F32, device=x.device)
        rstd = mean.new_empty(m)
        self.fwd.launch((xv, xv if weight is None else weight.view(-1) if self.pview else weight,
                         xv if bias is None else bias.view(-1) if self.pview else bias, y, mean, rstd, *self.geo, eps))
        return y.view(x.shape) if self.view else y, mean, rstd

    def backward_plan(self, i: int, x: Tensor, weight) -> object:
        """The kernels' backward plan of ``i`` = 2·need dw + need db, now (kept with the current epoch)."""
        dev = x.device  # (the general launcher's key: dy has the output's dtype, the statistics are fp32)
        key = (True, self.m, self.n, weight is not None, i > 1, i & 1 == 1, x.dtype, x.dtype, self.wdt, _F32, _F32,
               dev.type, dev.index)
        bp = self.lean.kernels().bwd_plan(key, dev)
        self.bwd[i] = (_epoch(), bp)
        return bp

    def backward(self, bp, dy: Tensor, x: Tensor, weight, mean, rstd) -> tuple:
        """``backward_checked``'s views (the 2-D rows, the 1-D parameters) around ``bp``'s launches."""
        m, n = self.m, self.n
        xv, g = (x.view(m, n), dy.contiguous().view(m, n)) if self.view else (x, dy.contiguous())
        dx, dw, db = bp.launch(self.geo, g, xv, weight.view(-1) if weight is not None and self.pview else weight,
                               mean, rstd, self.wdt, self.bdt,
                               torch.empty_like(xv) if self.sx is True else torch.empty_like(xv, memory_format=_CONTIG))
        if self.pview:  # (the parameters' gradients in their shape)
            dw = dw.view(self.shape) if dw is not None else None
            db = db.view(self.shape) if db is not None else None
        return dx.view(x.shape) if self.view else dx, dw, db


class _DirectOpenFoldLayerNorm(torch.autograd.Function):
    """``apply(x, weight, bias, plan, eps)``: the plan's forward, saving what the general Function saves; its
    backward, or the general backward wherever that is needed."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan, eps):
        if plan.plain:  # (LNPlan.run, inline: a frame less)
            m = plan.m
            y = x.new_empty(*plan.size) if plan.size else torch.empty_like(x)
            mean = x.new_empty(m) if plan.f32 else torch.empty(m, dtype=_F32, device=x.device)
            rstd = mean.new_empty(m)
            plan.fwd.launch((x, x if weight is None else weight, x if bias is None else bias, y, mean, rstd, *plan.geo,
                             eps))
        else:
            y, mean, rstd = plan.run(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        x, weight, bias, mean, rstd = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # The general backward wherever it is needed: a graph for a second derivative (its behaviour), a subclass
        # gradient, compiled autograd, a dispatch mode, a torch.func transform, a tracer; and saved tensors a
        # saved-tensor hook gave back in another layout (the plan's views and geometry would not be theirs).
        if (_grad_enabled() or type(dy) not in _PLAIN or _is_compiling() or _dispatch_modes()
                or _are_functorch_transforms_active() or _is_tracing()
                or not (x.is_contiguous() if plan.sx is True else x.stride() == plan.sx)
                or weight is not None and not weight.is_contiguous()):
            dx, dw, db = plan.lean.general(dy, x, plan.shape, plan.n, weight, bias, mean, rstd,
                                           (needs[0], needs[1], needs[2]), True)
            return dx, dw, db, None, None
        # backward_checked's kernel path: the same views, allocations and launches.
        i = 2 * (needs[1] and weight is not None) + (needs[2] and bias is not None)
        epoch, bp = plan.bwd[i]
        if epoch is not _EPOCH.get(0) or epoch is None:
            bp = plan.backward_plan(i, x, weight)
        if plan.plain:  # (LNPlan.backward, inline: a frame less)
            dx, dw, db = bp.launch(plan.geo, dy.contiguous(), x, weight, mean, rstd, plan.wdt, plan.bdt,
                                   x.new_empty(*plan.size) if plan.size else torch.empty_like(x))
        else:
            dx, dw, db = plan.backward(bp, dy, x, weight, mean, rstd)
        return dx if needs[0] else None, dw, db, None, None


_direct = super(torch.autograd.Function, _DirectOpenFoldLayerNorm).apply  # the C++ apply (no Python wrapper)


class Lean:
    """The plans of OpenFold's LayerNorm and its eager entry: :meth:`run` answers the output, or None where the
    general path must take the call (having changed nothing). ``check``: ``check_args``; ``general``:
    ``backward_checked``; ``kernel_dtypes``, ``max_n``: what ``use_kernel`` takes; ``kernels``: the kernel
    module's getter (imported at the first plan: importing apex imports no Triton)."""

    def __init__(self, check: Callable, general: Callable, kernel_dtypes, max_n: int, kernels: Callable):
        self.check, self.general, self.kernels = check, general, kernels
        self.dtypes, self.max_n = member_set(*kernel_dtypes), max_n
        self.table = PlanTable()
        self.shape_seen = _UNSEEN  # the last exact normalized_shape given (see run)

    def run(self, x: object, normalized_shape: object, weight: object, bias: object, eps: object) -> Tensor | None:
        # First: what torch.compile, torch.export, a dispatch mode, a torch.func transform or a tracer sees is the
        # general path (nothing planned under them), as are subclasses, non-tensors and an eps to convert.
        if (_is_compiling() or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()
                or type(x) not in _PLAIN or type(weight) not in _PLAIN_OR_NONE
                or type(bias) not in _PLAIN_OR_NONE or type(eps) is not float):
            return None
        # The backend before the key: another backend's call (the CPU's default) pays for no key, and plans are
        # only made where the Triton kernels run (the general path raises a backend's error, after its checks).
        on_gpu = x.is_cuda
        if not _triton_takes(on_gpu, x):
            return None
        if normalized_shape is not self.shape_seen:  # (the same object as the last call's: exact already)
            ns = _exact_shape(normalized_shape)
            if ns is None:
                return None
            if ns is normalized_shape:  # an int, a Size or a tuple of ints: immutable, held here by identity
                self.shape_seen = ns
            normalized_shape = ns
        # Every fact the checks and launches read (a contiguous input's strides are implied by its shape). A device
        # as the key holds it, without a torch.device built: by x's kind (the two kinds never mix in one key), a
        # CUDA tensor's index (another's device) where x is a CUDA tensor, else -1 for a CPU tensor (another's
        # device).
        if on_gpu:
            key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, x.get_device(), normalized_shape)
            if weight is not None:
                key += (weight.shape, weight.dtype, weight.is_contiguous(),
                        weight.get_device() if weight.is_cuda else weight.device)
            if bias is not None:  # (None marks the absent weight: a bias's facts never stand where a weight's do)
                key += (None, bias.shape, bias.dtype, bias.is_contiguous(),
                        bias.get_device() if bias.is_cuda else bias.device)
        elif weight is None:
            if bias is None:
                key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, -1 if x.is_cpu else x.device,
                       normalized_shape)
            else:
                key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, -1 if x.is_cpu else x.device,
                       normalized_shape, None, bias.shape, bias.dtype, bias.is_contiguous(),
                       -1 if bias.is_cpu else bias.device)
        elif bias is None:
            key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, -1 if x.is_cpu else x.device, normalized_shape,
                   weight.shape, weight.dtype, weight.is_contiguous(), -1 if weight.is_cpu else weight.device)
        else:
            key = (x.shape, x.is_contiguous() or x.stride(), x.dtype, -1 if x.is_cpu else x.device, normalized_shape,
                   weight.shape, weight.dtype, weight.is_contiguous(), -1 if weight.is_cpu else weight.device,
                   None, bias.shape, bias.dtype, bias.is_contiguous(), -1 if bias.is_cpu else bias.device)
        table = self.table
        plan = table.last.get(0)  # the last call's plan first: one comparison of the key
        if plan is None or plan.key != key:
            plan = table.plans.get(key)
            if plan is None:
                plan = table.keep(key, self._plan(key, x, normalized_shape, weight, bias))
            if not plan:
                return None
            table.last[0] = plan
        # Grad mode alone decides: the Function's output needs no gradient where none of its inputs does.
        if _grad_enabled():
            return _direct(x, weight, bias, plan, eps)
        return plan.run(x, weight, bias, eps)[0]

    def _plan(self, key: tuple, x: Tensor, normalized_shape, weight, bias) -> LNPlan | bool:
        """The plan of a key not seen yet (checked: the general path's errors); False where the kernels would not
        run the call as a plan does (``use_kernel`` says no, empty, rows or parameters the general path copies)."""
        shape, m, n = self.check(x, normalized_shape, weight, bias)
        if x.dtype not in self.dtypes or not 0 < n <= self.max_n or not m:
            return False
        if len(shape) == 1 and x.dim() <= 4:  # (_kernel_view: read in place, any strides)
            xv = x
        elif key[1] is True:  # a contiguous input's rows: a view
            xv = x.view(m, n)
        else:
            return False  # (copied by the general path)
        for p in (weight, bias):
            if p is not None and not p.is_contiguous():  # (_flat copies it)
                return False
        return LNPlan(key, x, xv, shape, m, n, weight, bias, self)
