"""Softmax cross entropy with label smoothing, per row (Apex's ``xentropy``).

For logits ``x`` of shape ``[..., V]`` and integer ``labels`` of shape ``[...]``:
``loss = lse(x) − (1−ε)·x[label] − ε·mean(x)`` with ``lse(x) = log Σ exp(x)``, i.e.
``(1−ε)·nll + ε·mean(−log p)``. Rows whose label equals ``padding_idx`` give zero loss and zero gradient.
The backward rebuilds the softmax from the saved ``lse`` (one value per row, no saved probabilities):
``dx = g · (exp(x − lse) − (1−ε)·onehot(label) − ε/V)``.

Dtype policy: arithmetic in fp32 (fp64 for fp64 logits); losses and ``lse`` are fp32 for fp16/bf16/fp32
logits (as Apex's kernel at e13873de, which always returns fp32 losses), fp64 for fp64; the gradient has
the logits' dtype. ``half_to_float`` is accepted for Apex's signature; it only decides the dtype of the
``max_log_sum_exp`` that the ``xentropy_cuda.forward`` adapter returns.

Labels outside ``[0, V)`` that are not ``padding_idx``: the PyTorch path (CPU tensors) raises ``ValueError``
naming the first one. The Triton path (CUDA/ROCm tensors) checks them in its kernels instead: such a row's
loss is NaN and its gradient zero, so a bad label shows in the loss (any reduction of it is NaN) without
the host reading the labels back: a check on the host would wait for the GPU (one synchronisation per call,
longer than the kernels themselves), where PyTorch's own CUDA ``cross_entropy`` asserts on the device
(aborting the process) and Liger-Kernel's checks nothing.

``inplace_backward=True`` (not in Apex) writes the logits' gradient over the logits' own buffer: for large
vocabularies the ``[rows, V]`` gradient is then never allocated next to the logits, which saves one
logits-sized buffer at the peak of the backward. The logits must not be used after the loss's backward
(they are overwritten), and they may not be a leaf tensor that requires grad.

Paths: CUDA/ROCm tensors run ``apex._kernels.xentropy`` (forward: one read of the logits with an online
log-sum-exp; backward: one read, one write); CPU tensors run PyTorch operators (``log_softmax`` in fp32 to
get ``lse``, a ``gather`` and a row sum; backward ``exp(x − lse)`` and two in-place updates). Both paths are
registered as the ``apex::softmax_xentropy_fwd`` / ``_bwd`` custom ops (fake implementations, autograd), which
``torch.compile``, export, dispatch modes and ``torch.func`` see; eager calls on plain tensors skip them.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch._C import _are_functorch_transforms_active
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex._backend import select_tensor
from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._checks import member_set
from apex.ops._dispatch import custom_op, lazy_module
from apex.ops._norm import _same_device, select
from apex.ops._xentropy_direct import Lean

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.xentropy")


# ----------------------------------------------------------------------------------------------- checks
_INDEX_DTYPES = (torch.int64, torch.int32)  # the usual labels: no three dtype queries
# Sets: a dtype's membership by its hash (a tuple compares it with each entry in turn).
_QUICK_LOGITS = member_set(torch.float32, torch.float16, torch.bfloat16, torch.float64)
_QUICK_LABELS = member_set(*_INDEX_DTYPES)
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _check(logits: object, labels: object, smoothing: object, padding_idx: object) -> int:
    # What Apex's xentropy_cuda checked (TORCH_CHECK: the dtypes, the shapes, CUDA tensors) raises errors that
    # are also its RuntimeError. The usual call (plain [rows, V] logits of a common float dtype, [rows] int
    # labels on their device, a float smoothing in [0, 1], an int padding_idx) passes one quick test reading each
    # fact once; anything else, or anything wrong, takes the checks below (their errors).
    if (type(logits) in _PLAIN and type(labels) in _PLAIN and logits.dtype in _QUICK_LOGITS
            and labels.dtype in _QUICK_LABELS and type(smoothing) is float and 0.0 <= smoothing <= 1.0
            and (type(padding_idx) is int or padding_idx is None)):
        shape, lshape = logits.shape, labels.shape
        if (len(shape) == 2 and len(lshape) == 1 and lshape[0] == shape[0] and shape[1] > 0
                and _same_device(labels, logits)):
            return shape[1]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise RuntimeTypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    shape = logits.shape  # read once (each read builds a torch.Size)
    if not shape or shape[-1] == 0:
        raise RuntimeValueError(f"logits must have shape [..., V] with V > 0, got {list(shape)}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if labels.dtype not in _INDEX_DTYPES and (labels.is_floating_point() or labels.is_complex()
                                              or labels.dtype == torch.bool):
        raise RuntimeTypeError(f"labels must be an integer tensor, got {labels.dtype}")
    lshape = labels.shape
    # [rows] labels of [rows, V] logits (the usual call) compare one size, without a torch.Size slice.
    if not (len(shape) == 2 and len(lshape) == 1 and lshape[0] == shape[0] or lshape == shape[:-1]):
        raise RuntimeValueError(f"labels must have shape {list(shape[:-1])} (logits without the class "
                                f"dimension), got {list(lshape)}")
    if not _same_device(labels, logits):
        raise RuntimeValueError(f"labels is on {labels.device} but logits is on {logits.device}")
    if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"smoothing must be a float in [0, 1], got {smoothing!r}")
    if padding_idx is not None and (isinstance(padding_idx, bool) or not isinstance(padding_idx, int)):
        raise TypeError(f"padding_idx must be an int or None, got {type(padding_idx).__name__}")
    return shape[-1]


def _check_labels(labels: Tensor, v: int, padding_idx: int | None) -> None:
    """Labels in ``[0, V)`` or ``padding_idx``, read on the host: the PyTorch path's check (the Triton
    path's kernels give those rows a NaN loss instead, without a device synchronisation)."""
    if labels.numel() and (padding_idx is None or 0 <= padding_idx < v):
        # Every allowed label lies in [0, V): one reduction and one read instead of four operators.
        lo, hi = torch.stack(labels.reshape(-1).aminmax()).tolist()
        if lo < 0 or hi >= v:
            first = int(labels.reshape(-1)[(labels.reshape(-1) < 0) | (labels.reshape(-1) >= v)][0])
            raise ValueError(f"labels must lie in [0, {v}) or equal padding_idx={padding_idx}, got {first}")
    elif labels.numel():
        bad = (labels < 0) | (labels >= v)
        if padding_idx is not None:
            bad &= labels != padding_idx
        if bool(bad.any()):
            first = int(labels.reshape(-1)[bad.reshape(-1)][0])
            raise ValueError(f"labels must lie in [0, {v}) or equal padding_idx={padding_idx}, got {first}")


_NO_PAD = -(1 << 63)


def _pad(padding_idx: int | None) -> int:
    # No padding: the smallest int64, so that a label of -1 (or any other out-of-range value a caller may
    # pass) still gives the Triton path's NaN, not a padding row's zero.
    return _NO_PAD if padding_idx is None else int(padding_idx)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- dispatch (no autograd)
def softmax_cross_entropy_forward(logits: Tensor, labels: Tensor, smoothing: float = 0.0,
                                  padding_idx: int | None = 0) -> tuple[Tensor, Tensor]:
    """``(losses, lse)``: per-row losses (zero on padding rows) and ``log Σ exp`` of each row. Out-of-range
    labels: ``ValueError`` on the PyTorch path, a NaN loss on the Triton path (see the module docstring)."""
    return _forward(logits, labels, smoothing, padding_idx)[:2]


def _forward(logits: Tensor, labels: Tensor, smoothing: float, padding_idx: int | None, eager: bool = False
             ) -> tuple[Tensor, Tensor, ModuleType | None]:
    """:func:`softmax_cross_entropy_forward` and the path it took: the kernels' module, or None for PyTorch's
    (the eager backward takes the same path without choosing again). ``eager``: the caller knows it is not
    being traced (the backend is chosen without ``select``'s tracing query)."""
    v = _check(logits, labels, smoothing, padding_idx)
    flat = logits.dim() == 2  # the usual [rows, V]: no reshape in or out (each ~1.5-3 µs)
    x = logits if flat else logits.reshape(-1, v)
    lab = labels if flat else labels.reshape(-1)
    if (select_tensor(logits) if eager else select(logits)) == "triton" and logits.dtype != torch.float64:
        kernels = _kernels()
        if x.stride()[1] != 1:  # (one tuple: stride(-1) parses its int-or-name overloads on every call)
            x = x.contiguous()
        losses, lse = kernels.forward(x, lab.contiguous(), float(smoothing), _pad(padding_idx))
    else:
        kernels = None
        _check_labels(labels, v, padding_idx)
        losses, lse = _forward_torch(x, lab, float(smoothing), padding_idx)
    if flat:
        return losses, lse, kernels
    lead = logits.shape[:-1]
    return losses.reshape(lead), lse.reshape(lead), kernels


def _forward_torch(x, lab, smoothing, padding_idx):
    ct = _compute_dtype(x.dtype)
    v = x.shape[-1]
    pad = lab == padding_idx if padding_idx is not None else torch.zeros_like(lab, dtype=torch.bool)
    safe = lab.masked_fill(pad, 0).unsqueeze(-1)
    # One fused pass for the log-probabilities (half inputs read directly into fp32); lse = x − log p.
    logp = torch.log_softmax(x, -1, dtype=ct)
    lse = x[:, :1].to(ct).sub(logp[:, :1]).squeeze(-1)
    nll = logp.gather(-1, safe).squeeze(-1).neg_()
    losses = nll.mul_(1.0 - smoothing)
    if smoothing:
        losses.sub_(logp.sum(-1), alpha=smoothing / v)
    return losses.masked_fill_(pad, 0), lse


def softmax_cross_entropy_backward(grad_loss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor,
                                   smoothing: float = 0.0, padding_idx: int | None = 0,
                                   inplace: bool = False) -> Tensor:
    """Gradient of the losses with respect to the logits; ``inplace=True`` writes it over ``logits``."""
    v = _check(logits, labels, smoothing, padding_idx)
    if select(logits) != "triton" or logits.dtype == torch.float64:
        _check_labels(labels, v, padding_idx)
    lead = tuple(logits.shape[:-1])
    for name, t in (("grad_loss", grad_loss), ("max_log_sum_exp", lse)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != lead:
            got = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeValueError(f"{name} must have shape {list(lead)}, got {got}")
        # The kernels read it next to the logits: a pointer of another device is an illegal access there.
        if not _same_device(t, logits):
            raise RuntimeValueError(f"{name} is on {t.device} but logits is on {logits.device}")
    if inplace and not logits.is_contiguous():
        raise ValueError("inplace_backward=True needs contiguous logits (the gradient is written over them)")
    return _backward(grad_loss, logits, lse, labels, smoothing, padding_idx, inplace)


_CHOOSE = object()  # _backward's kernels argument: pick the path (the forward's choice is not known)


def _backward(grad_loss, logits, lse, labels, smoothing, padding_idx, inplace, kernels=_CHOOSE):
    """:func:`softmax_cross_entropy_backward` on arguments already checked (by it, or by the forward that
    saved them): no second pass over the labels. ``kernels``: the forward's path (its kernels' module, or None
    for PyTorch's), taken again without asking the backend."""
    flat = logits.dim() == 2  # the usual [rows, V]: no reshape in or out, no shape read
    if flat:
        x, lab, g, s = logits, labels, grad_loss, lse
    else:
        x, lab, g, s = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), grad_loss.reshape(-1), lse.reshape(-1)
    from_forward = kernels is not _CHOOSE
    if not from_forward:
        kernels = _kernels() if select(logits) == "triton" and logits.dtype != torch.float64 else None
    if kernels is not None:
        if inplace:
            out = x
        else:
            if x.stride()[1] != 1:
                x = x.contiguous()
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if not from_forward:  # (the forward's lse is its own contiguous fp32 buffer)
            s = s.float().contiguous()
        kernels.backward(g, x, lab.contiguous(), s, float(smoothing), _pad(padding_idx), out)
        if flat:
            return out
        return out.view(logits.shape) if inplace else out.reshape(logits.shape)
    dx = _backward_torch(g, x, lab, s, float(smoothing), padding_idx, inplace)
    return dx.view(logits.shape)


def _backward_torch(g, x, lab, lse, smoothing, padding_idx, inplace):
    ct = _compute_dtype(x.dtype)
    v = x.shape[-1]
    g = g.to(ct)
    if padding_idx is not None:
        g = g.masked_fill(lab == padding_idx, 0)
        safe = lab.masked_fill(lab == padding_idx, 0)
    else:
        safe = lab
    # In place only where the arithmetic dtype is the logits' own (fp32/fp64); half logits need fp32 work.
    if inplace and x.dtype == ct:
        p = x.sub_(lse.unsqueeze(-1).to(ct))
    else:  # a half x minus an fp32 lse promotes to fp32
        p = torch.sub(x, lse.unsqueeze(-1).to(ct))
    p = p.exp_()
    p.mul_(g.unsqueeze(-1))
    if smoothing:
        p.sub_((g * (smoothing / v)).unsqueeze(-1))
    rows = torch.arange(x.shape[0], device=x.device)
    p.index_put_((rows, safe), g * (smoothing - 1.0), accumulate=True)
    if p.dtype == x.dtype:
        return p
    return x.copy_(p) if inplace else p.to(x.dtype)


# ------------------------------------------------------------------------------------------ custom ops
# What torch.compile (fullgraph=True included), export, dispatch modes and torch.func see: one opaque op each
# way, with fake implementations, instead of the launcher (which Dynamo cannot trace). Eager calls on plain
# tensors skip them (SoftmaxCrossEntropyLoss.apply).
@custom_op("apex::softmax_xentropy_fwd")
def _fwd_op(logits: Tensor, labels: Tensor, smoothing: float, padding_idx: int | None) -> tuple[Tensor, Tensor]:
    losses, lse = softmax_cross_entropy_forward(logits, labels, smoothing, padding_idx)
    return losses, lse


@_fwd_op.register_fake
def _(logits, labels, smoothing, padding_idx):
    lead, ct = logits.shape[:-1], _compute_dtype(logits.dtype)  # losses and lse in the arithmetic dtype
    return logits.new_empty(lead, dtype=ct), logits.new_empty(lead, dtype=ct)


@custom_op("apex::softmax_xentropy_bwd")
def _bwd_op(grad_loss: Tensor, logits: Tensor, lse: Tensor, labels: Tensor, smoothing: float,
            padding_idx: int | None) -> Tensor:
    # Never in place (a custom op may not return its input), and contiguous as the fake says.
    return _backward(grad_loss, logits, lse, labels, smoothing, padding_idx, False).contiguous()


@_bwd_op.register_fake
def _(grad_loss, logits, lse, labels, smoothing, padding_idx):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    logits, labels, smoothing, padding_idx = inputs
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(logits, output[1], labels)
    ctx.smoothing, ctx.padding_idx = smoothing, padding_idx


def _op_backward(ctx, grad_loss, _grad_lse):
    logits, lse, labels = ctx.saved_tensors
    return _bwd_op(grad_loss, logits, lse, labels, ctx.smoothing, ctx.padding_idx), None, None, None


_fwd_op.register_autograd(_op_backward, setup_context=_setup)


def _bind(logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False, inplace_backward=False):
    """``apply``'s arguments, defaults filled in (Python's own TypeError for a wrong call)."""
    return logits, labels, smoothing, padding_idx, half_to_float, inplace_backward


_bind.__qualname__ = "SoftmaxCrossEntropyLoss.apply"  # the name a wrong call's TypeError shows


class _FuncLoss(torch.autograd.Function):
    """The registered ops inside a Function that ``torch.func`` transforms accept (a separate
    ``setup_context``; the custom op's own autograd has none, which the transforms refuse)."""

    @staticmethod
    def forward(logits, labels, smoothing, padding_idx):
        return _fwd_op(logits, labels, smoothing, padding_idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx, grad_loss, _grad_lse):
        # The transforms run the backward with grad on; the backward op has no derivative of its own (first
        # order only, as the eager Function).
        with torch.no_grad():
            return _op_backward(ctx, grad_loss, _grad_lse)


def _op_loss(logits, labels, smoothing, padding_idx, half_to_float, inplace_backward):
    """The losses through the registered op (dispatch modes, export, a call Dynamo did not take as the
    Function's), differentiated by its registered autograd, or inside ``torch.func`` transforms by
    :class:`_FuncLoss`. ``inplace_backward`` is checked, then has no effect: the op's backward writes a new
    tensor."""
    _check_inplace(logits, inplace_backward)
    _check(logits, labels, smoothing, padding_idx)
    if _are_functorch_transforms_active():
        return _FuncLoss.apply(logits, labels, float(smoothing), padding_idx)[0]
    return _fwd_op(logits, labels, float(smoothing), padding_idx)[0]


# --------------------------------------------------------------------------------------------- autograd
class SoftmaxCrossEntropyLoss(torch.autograd.Function):
    """``SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False,
    inplace_backward=False)`` → per-row losses (fp32 for half/float logits).

    ``torch.compile`` traces this Function's ``forward`` and ``backward``, which call the registered ops
    (``apex::softmax_xentropy_fwd`` / ``_bwd``): one graph, the ops opaque in it. Eager calls take
    :class:`_EagerLoss`, which launches the kernels without the ops' dispatcher layers."""

    @classmethod
    def apply(cls, *args, **kwargs):
        """``Function.apply``: outside ``torch.func`` transforms and dispatch modes, :class:`_EagerLoss`'s
        through its C++ form (the Python wrapper binds defaults and unwraps ``torch.func``'s dead wrappers,
        ~4 µs a call); with nothing to differentiate the forward runs alone, without the Function's context
        and saved tensors. Under a transform or mode, the registered op. ``torch.compile`` traces the
        Function itself (Dynamo takes ``apply`` of an autograd Function without calling this)."""
        if kwargs or not 2 <= len(args) <= 6:
            args = _bind(*args, **kwargs)
        out = _lean(*args)  # a planned eager Triton call: its checks passed for the same facts
        if out is not None:
            return out
        if _are_functorch_transforms_active() or _dispatch_modes() or torch.compiler.is_compiling():
            return _op_loss(*_bind(*args))
        logits = args[0]
        if torch.is_grad_enabled() and isinstance(logits, torch.Tensor) and logits.requires_grad:
            return _c_apply(*args)
        smoothing, padding_idx, _, inplace_backward = args[2:] + (0.0, 0, False, False)[len(args) - 2:]
        _check_inplace(logits, inplace_backward)
        return _forward(logits, args[1], smoothing, padding_idx, True)[0]

    @staticmethod
    def forward(ctx, logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False, inplace_backward=False):
        _check_inplace(logits, inplace_backward)
        _check(logits, labels, smoothing, padding_idx)
        losses, lse = _fwd_op(logits, labels, float(smoothing), padding_idx)
        ctx.save_for_backward(logits, lse, labels)
        ctx.smoothing = float(smoothing)
        ctx.padding_idx = padding_idx
        return losses

    @staticmethod
    def backward(ctx, grad_loss):
        logits, lse, labels = ctx.saved_tensors
        return _bwd_op(grad_loss, logits, lse, labels, ctx.smoothing, ctx.padding_idx), None, None, None, None, None


def _eager_forward(ctx, logits, labels, smoothing=0.0, padding_idx=0, half_to_float=False, inplace_backward=False):
    if inplace_backward:
        _check_inplace(logits, inplace_backward)
    losses, lse, kernels = _forward(logits, labels, smoothing, padding_idx, True)
    ctx.save_for_backward(logits, lse, labels)
    ctx.args = (float(smoothing), padding_idx, bool(inplace_backward), kernels)  # one attribute, not four
    return losses


def _eager_backward(ctx, grad_loss):
    logits, lse, labels = ctx.saved_tensors
    # The forward checked logits and labels (the saved tensors are those), and autograd gives grad_loss the
    # losses' shape (a gradient of another shape fails in autograd's own check): nothing to check again.
    dx = _backward(grad_loss, logits, lse, labels, *ctx.args)
    return dx, None, None, None, None, None


# The eager Function: the kernels launched directly. Named as the public class, so that its graph nodes read
# SoftmaxCrossEntropyLossBackward as before.
_EagerLoss = type("SoftmaxCrossEntropyLoss", (torch.autograd.Function,), {
    "__module__": __name__, "__qualname__": "_EagerLoss",
    "forward": staticmethod(_eager_forward), "backward": staticmethod(_eager_backward)})
_c_apply = super(torch.autograd.Function, _EagerLoss).apply  # the C++ Function.apply

# The planned eager Triton path (apex.ops._xentropy_direct): a call whose layout and scalars were checked
# before launches from its plan; None for anything else (the general path, its checks and errors).
_lean = Lean(_kernels, _check, _pad, _eager_backward).run


def _check_inplace(logits: object, inplace_backward: object) -> None:
    if inplace_backward and isinstance(logits, torch.Tensor) and logits.is_leaf and logits.requires_grad:
        raise ValueError("inplace_backward=True would overwrite logits, a leaf tensor that requires grad: "
                         "pass the output of a layer, or inplace_backward=False")


def softmax_cross_entropy(logits: Tensor, labels: Tensor, smoothing: float = 0.0, padding_idx: int | None = 0,
                          half_to_float: bool = False, inplace_backward: bool = False) -> Tensor:
    """Differentiable per-row label-smoothed cross entropy (see the module docstring)."""
    return SoftmaxCrossEntropyLoss.apply(logits, labels, smoothing, padding_idx, half_to_float, inplace_backward)


# ---------------------------------------------------------------------- Apex's ``xentropy_cuda`` entry points
def forward(input: Tensor, labels: Tensor, smoothing: float, half_to_float: bool) -> list[Tensor]:
    """``xentropy_cuda.forward``: ``[losses, max_log_sum_exp]`` (no padding row masking, as Apex's)."""
    losses, lse = softmax_cross_entropy_forward(input, labels, smoothing, None)
    if not half_to_float and input.dtype in (torch.float16, torch.bfloat16):
        lse = lse.to(input.dtype)
    return [losses, lse]


def backward(grad_loss: Tensor, logits: Tensor, max_log_sum_exp: Tensor, labels: Tensor, smoothing: float
             ) -> Tensor:
    """``xentropy_cuda.backward``: the logits' gradient (rows are not masked here, as in Apex)."""
    return softmax_cross_entropy_backward(grad_loss, logits, max_log_sum_exp, labels, smoothing, None)
