"""RNN-T (transducer) loss: ``loss[b] = −log Σ_paths Π p`` over the (f_len[b] × (y_len[b]+1)) lattice.

With ``lp = log_softmax(x)``, ``α(0,0) = 0``, ``α(t,u) = lae(α(t−1,u) + lp_blank(t−1,u), α(t,u−1) +
lp_{y_u}(t,u−1))`` and ``β(T−1,U) = lp_blank(T−1,U)``, ``β(t,u) = lae(β(t+1,u) + lp_blank(t,u), β(t,u+1) +
lp_{y_{u+1}}(t,u))`` (``lae`` = log-add-exp; T = f_len[b], U = y_len[b]); ``loss = −β(0,0)``. The gradient of
``lp`` at (t, u) has two terms, ``−exp(α + lp + β(next) − log Z)`` for the blank and for the label; with
``fuse_softmax_backward`` the softmax backward is folded in:
``∂x_v = exp(lp_v + α + β − log Z) − (the two terms)``.

Input ``x`` is dense (B, T, U, V) or packed (Σ f_len·(y_len+1), V) with ``batch_offset = cumsum(f_len·(y_len+1))``.

Dtype policy: the log-softmax, α, β and the gradient are computed in fp32 (fp64 for fp64 ``x``), rounded
once to ``x``'s dtype (loss and gradient). Unlike Apex, which saves the (B, T, U, V) log-softmax in ``x``'s
dtype, only the fp32 log-sum-exp of each row is saved and the softmax is rebuilt from ``x`` in the
backward: less memory, and fp16 logits lose no accuracy to a rounded log-softmax.

Paths: CUDA/ROCm tensors run the wavefront kernels of ``apex._kernels.transducer_loss`` (one program per
batch element walks the anti-diagonals); CPU tensors run the same anti-diagonal recursion in PyTorch,
vectorised over the batch and over each diagonal (strided views of a padded lattice, one update per
diagonal), and a vectorised gradient. On the Triton path dense logits' eager calls take a plan per argument layout
(:mod:`apex.ops._transducer_direct`: the same launches, less host time per call).
"""

from __future__ import annotations

import torch

from apex import _backend
from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._checks import member_set
from apex.ops._dispatch import lazy_module
from apex.ops._norm import _same_device
from apex.ops._transducer_direct import LossLean
from apex.ops._transducer_lattice import (
    _NEG,
    _alpha_beta_torch,
    _coefficients,
    _gather,
    _in_bounds,
    _out_of_range,
    _padded,
)

Tensor = torch.Tensor


def _acc(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


_FLOATS = member_set(torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INTS = member_set(torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def check_args(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input, ranges: bool = True):
    """Validate the arguments; returns the lattice size ``(T, U)``. ``ranges=False`` (a dense input on the
    Triton path, whose kernels check the values themselves) checks shapes, dtypes and ``blank_idx`` only:
    no host read of the lengths or labels (a GPU synchronisation per call)."""
    # The usual call (dense logits; integer labels and lengths on one device, of one batch size, in range) is
    # tested first, reading each attribute once; anything else, or a value out of range, takes the checks
    # below, which word the error.
    if (not packed_input and type(blank_idx) is int and isinstance(x, Tensor) and isinstance(label, Tensor)
            and isinstance(f_len, Tensor) and isinstance(y_len, Tensor) and x.dtype in _FLOATS
            and label.dtype in _INTS and f_len.dtype in _INTS and y_len.dtype in _INTS):
        shape, fs, ls = x.shape, f_len.shape, label.shape
        if (len(shape) == 4 and len(ls) == 2 and len(fs) == 1 and ls[0] == fs[0] == shape[0] > 0
                and y_len.shape == fs and 0 <= blank_idx < shape[3]):
            dev = label.device
            if not ranges:
                return shape[1], shape[2]
            if f_len.device == dev and y_len.device == dev:
                if _in_bounds(label, f_len, y_len, fs[0], ls[1], shape[1], shape[2], shape[3]):
                    return shape[1], shape[2]
                return _out_of_range(x, label, f_len, y_len, batch_offset, max_f_len, packed_input)
    # Where Apex's transducer_loss_cuda raised RuntimeError (the dtypes it dispatched on or read as int,
    # blank_idx), the error is also a RuntimeError.
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise RuntimeTypeError("x must be a floating-point tensor")
    if x.dim() != (2 if packed_input else 4):
        raise ValueError(f"x must be {'(rows, V)' if packed_input else '(B, T, U, V)'}, got shape {tuple(x.shape)}")
    for name, t in (("label", label), ("f_len", f_len), ("y_len", y_len)):
        if not isinstance(t, Tensor) or t.is_floating_point() or t.dtype == torch.bool:
            raise RuntimeTypeError(f"{name} must be an integer tensor")
    B = f_len.shape[0] if f_len.dim() == 1 else -1
    if f_len.dim() != 1 or y_len.shape != (B,) or label.dim() != 2 or label.shape[0] != B:
        raise ValueError(f"f_len and y_len must be 1-D of the batch size and label 2-D (B, max label length); "
                         f"got f_len {tuple(f_len.shape)}, y_len {tuple(y_len.shape)}, label {tuple(label.shape)}")
    V = x.shape[-1]
    if not isinstance(blank_idx, int) or not 0 <= blank_idx < V:
        raise RuntimeValueError(f"blank_idx must be an int in [0, {V}), got {blank_idx!r}")
    if B == 0:
        return 0, 1
    if not (ranges or packed_input):
        if x.shape[0] != B:
            raise ValueError(f"x has batch size {x.shape[0]} but f_len has {B}")
        return x.shape[1], x.shape[2]
    if not packed_input and label.device == f_len.device == y_len.device and x.shape[0] == B:
        T, U = x.shape[1], x.shape[2]
        if _in_bounds(label, f_len, y_len, B, label.shape[1], T, U, V):
            return T, U
    return _out_of_range(x, label, f_len, y_len, batch_offset, max_f_len, packed_input)


# --------------------------------------------------------------------------------- dispatch (no autograd)
def row_lse(x: Tensor) -> Tensor:
    """Per-row log-sum-exp of the logits in fp32 (fp64 for fp64 ``x``): what the loss saves for its backward."""
    if _backend.select(x) == "triton":
        from apex._kernels import transducer_loss as kernels

        return kernels.row_lse(x.contiguous(), _acc(x.dtype))
    return torch.logsumexp(x.to(_acc(x.dtype)), dim=-1)


def loss_forward(logp: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, batch_offset: Tensor | None,
                 max_f_len: int | None, blank_idx: int, packed_input: bool = False, lse: Tensor | None = None
                 ) -> tuple[Tensor, Tensor, Tensor]:
    """``(alpha, beta, loss)`` from log-probabilities ``logp``, or from logits ``logp`` and their row
    log-sum-exps ``lse``; alpha and beta are (B, T, U), −inf outside the lengths."""
    triton = _backend.select(logp) == "triton"
    T, U = check_args(logp, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input, not triton)
    acc = _acc(logp.dtype)
    if triton:
        lse = lse.contiguous() if lse is not None else logp.new_zeros(logp.shape[:-1], dtype=acc)
        return _alpha_beta_triton(logp.contiguous(), lse, label, f_len, y_len, batch_offset, T, U, blank_idx,
                                  packed_input, acc)
    lpb, lpl, valid, _ = _gather(logp, lse, label, f_len, y_len, T, U, blank_idx, packed_input, acc)
    alpha, beta, _, _ = _alpha_beta_torch(lpb, lpl, f_len, y_len)
    loss = -beta[:, 1, 1]
    alpha = alpha[:, 1:-1, 1:-1].masked_fill(~valid, _NEG)
    return alpha, beta[:, 1:-1, 1:-1].contiguous(), loss.to(logp.dtype)


def _alpha_beta_triton(logp, lse, label, f_len, y_len, batch_offset, T: int, U: int, blank_idx: int,
                       packed_input: bool, acc: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`loss_forward`'s kernels on the contiguous ``logp`` and ``lse``, the arguments already checked."""
    dev = logp.device
    boff = batch_offset.to(dev, torch.int64).contiguous() if packed_input else None
    alpha, beta, loss = _kernels().alpha_beta(logp, lse, _on(label, dev), _on(f_len, dev, torch.int32),
                                              _on(y_len, dev, torch.int32), boff, T, U, blank_idx, packed_input,
                                              acc)
    return alpha, beta, (loss if loss.dtype == logp.dtype else loss.to(logp.dtype))


def _on(t: Tensor, dev: torch.device, dtype: torch.dtype | None = None) -> Tensor:
    """``t`` contiguous on ``dev`` (in ``dtype``) for the kernels; the usual tensors already are (a no-op
    ``.to`` is still an operator call, ~1 µs)."""
    if t.device != dev or (dtype is not None and t.dtype != dtype):
        t = t.to(dev, dtype)
    return t.contiguous()


_KERNELS: list = []


def _kernels():
    """``apex._kernels.transducer_loss``, imported on first use (an import statement costs ~1 µs a call)."""
    if not _KERNELS:
        from apex._kernels import transducer_loss

        _KERNELS.append(transducer_loss)
    return _KERNELS[0]


def loss_backward(logp: Tensor, loss_grad: Tensor, alpha: Tensor, beta: Tensor, f_len: Tensor, y_len: Tensor,
                  label: Tensor, batch_offset: Tensor | None, blank_idx: int, fused: bool, packed_input: bool,
                  out_dtype: torch.dtype | None = None, lse: Tensor | None = None) -> Tensor:
    """Gradient with respect to the logits (``fused``) or to the log-probabilities (otherwise).

    ``logp`` holds log-probabilities, or logits when their row log-sum-exps ``lse`` are given."""
    B, T, U = alpha.shape
    acc = alpha.dtype
    out_dtype = out_dtype or logp.dtype
    if _backend.select(logp) == "triton":
        # The lengths and labels are moved to logp's device below; these the kernel reads where they are: a
        # pointer of another device is an illegal access there.
        for name, t in (("loss_grad", loss_grad), ("alpha", alpha), ("beta", beta), ("lse", lse)):
            if t is not None and not _same_device(t, logp):
                raise RuntimeValueError(f"{name} is on {t.device} but x is on {logp.device}")
        kernels = _kernels()
        dev = logp.device
        boff = row_b = None
        if packed_input:
            boff = batch_offset.to(dev, torch.int64).contiguous()
            counts = f_len.to(dev).long() * (y_len.to(dev).long() + 1)
            row_b = torch.repeat_interleave(torch.arange(B, device=dev, dtype=torch.int32), counts)
        lse = lse.contiguous() if lse is not None else logp.new_zeros(logp.shape[:-1], dtype=acc)
        return kernels.grad(logp.contiguous(), lse, loss_grad.contiguous(), alpha.contiguous(), beta.contiguous(),
                            _on(label, dev), _on(f_len, dev, torch.int32), _on(y_len, dev, torch.int32),
                            boff, row_b, blank_idx, packed_input, fused, out_dtype)
    lpb, lpl, valid, lab = _gather(logp, lse, label, f_len, y_len, T, U, blank_idx, packed_input, acc)
    pa, pbeta = _padded(alpha, B, T, U).view(B, T + 2, U + 2), _padded(beta, B, T, U).view(B, T + 2, U + 2)
    pbeta.view(B, -1).scatter_(1, ((f_len.long() + 1) * (U + 2) + y_len.long() + 1).view(-1, 1), 0.0)
    c_all, c_blank, c_label = _coefficients(pa, pbeta, _padded(lpb, B, T, U).view(B, T + 2, U + 2),
                                            _padded(lpl, B, T, U).view(B, T + 2, U + 2), loss_grad)
    lab = lab.unsqueeze(1).expand(B, T, U)
    if packed_input:  # boolean indexing of the lattice walks cells in packed-row order
        c_all, c_blank, c_label, lab, valid = c_all[valid], c_blank[valid], c_label[valid], lab[valid], None
    if fused:
        # softmax(logits) = exp(logits − lse): PyTorch's fused softmax is one pass
        g = torch.exp(logp.to(acc)) if lse is None else torch.softmax(logp.to(acc), dim=-1)
        g = g.mul_(c_all.unsqueeze(-1))
        if valid is not None:
            g.masked_fill_(~valid.unsqueeze(-1), 0.0)
    else:
        g = torch.zeros(logp.shape, dtype=acc, device=logp.device)
    g[..., blank_idx] -= c_blank
    g.scatter_add_(-1, lab.unsqueeze(-1), -c_label.unsqueeze(-1))
    return g.to(out_dtype)


def _check_opt(opt) -> None:
    # Apex's kernel TORCH_CHECKs the optimisation level (it picks the CUDA algorithm; here it picks nothing).
    if opt not in (-1, 0, 1):
        raise RuntimeValueError(f"opt must be -1, 0 or 1 (Apex: invalid optimization level), got {opt!r}")


# ------------------------------------------------------------------------------------------- autograd
def loss_and_saved(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, debug_list, opt, packed_input
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, tuple | None]:
    """``(loss, lse, alpha, beta, lengths)``: :class:`TransducerLossFunc`'s forward and what its backward needs
    (the modules call it alone when there is no gradient to record); ``lengths`` is ``(label, f_len, y_len,
    sizes)`` on the Triton path: the labels and lengths as its kernels read them (on ``x``'s device, the
    lengths int32) and, for the usual dense call, ``(B, T, U, V, label length)`` (else None); None on the
    PyTorch path."""
    if opt != 1:  # (the usual value first: a call costs ~0.3 µs)
        _check_opt(opt)
    # Only the per-row log-sum-exp is kept (fp32): the backward rebuilds the softmax from the logits.
    if (_backend.select_tensor(x) if isinstance(x, Tensor) else _backend.select(x)) == "triton":
        if not packed_input:
            out = _usual_dense(x, label, f_len, y_len, blank_idx)
            if out is not None:
                if debug_list == []:
                    debug_list += out[2:4]
                return out
        kernels = _kernels()
        T, U = check_args(x, label, f_len, y_len, blank_idx, batch_offset, max_f_len, packed_input, False)
        dtype = x.dtype
        acc = _acc(dtype)
        xc = x.contiguous()
        dev = xc.device
        lengths = _on(label, dev), _on(f_len, dev, torch.int32), _on(y_len, dev, torch.int32), None
        lse = kernels.row_lse(xc, acc)
        boff = batch_offset.to(dev, torch.int64).contiguous() if packed_input else None
        alpha, beta, loss = kernels.alpha_beta(xc, lse, *lengths[:3], boff, T, U, blank_idx, packed_input, acc)
        if loss.dtype != dtype:
            loss = loss.to(dtype)
        if debug_list == []:
            debug_list += [alpha, beta]
        return loss, lse, alpha, beta, lengths
    # PyTorch's fused log-softmax is several times faster than its logsumexp on CPU
    logp = torch.log_softmax(x.to(_acc(x.dtype)), dim=-1)
    lse = x[..., 0].to(logp.dtype) - logp[..., 0]
    alpha, beta, loss = loss_forward(logp, label, f_len, y_len, batch_offset, max_f_len, blank_idx, packed_input)
    loss = loss.to(x.dtype)
    del logp
    if debug_list == []:
        debug_list += [alpha, beta]
    return loss, lse, alpha, beta, None


def _usual_dense(x, label, f_len, y_len, blank_idx) -> tuple | None:
    """The Triton path of the usual call, :func:`loss_and_saved`'s answer: dense logits of a float dtype, integer
    labels and lengths of one batch size, ``blank_idx`` in range; None for any other call (the full checks
    then word the error). Each fact is read once and the sizes go to the launcher as integers; the values'
    ranges are checked in the kernels."""
    if not (type(blank_idx) is int and isinstance(label, Tensor) and isinstance(f_len, Tensor)
            and isinstance(y_len, Tensor)):
        return None
    shape, ls, fs = x.shape, label.shape, f_len.shape
    if not (len(shape) == 4 and len(ls) == 2 and len(fs) == 1 and ls[0] == fs[0] == shape[0] > 0
            and y_len.shape == fs and 0 <= blank_idx < shape[3]):
        return None
    dtype, ldt, fdt, ydt = x.dtype, label.dtype, f_len.dtype, y_len.dtype
    if not (dtype in _FLOATS and ldt in _INTS and fdt in _INTS and ydt in _INTS):
        return None
    where = x.get_device()  # (an integer, -1 for the CPU: cheaper to read and compare than a torch.device)
    if label.get_device() != where or f_len.get_device() != where or y_len.get_device() != where:
        return None  # (the general path moves them to x's device)
    f32 = f_len if fdt is torch.int32 else f_len.to(torch.int32)
    y32 = y_len if ydt is torch.int32 else y_len.to(torch.int32)
    sizes = (*shape, ls[1])
    lengths = label.contiguous(), f32.contiguous(), y32.contiguous(), sizes
    # (acc None: x's own dtype, fp32 or fp64)
    acc = None if dtype is torch.float32 or dtype is torch.float64 else torch.float32
    return (*_kernels().forward_dense(x.contiguous(), *lengths, blank_idx, acc), lengths)


_NO_GRADS = (None,) * 10  # the gradients of the Function's arguments after x


class TransducerLossFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, fuse_softmax_backward,
                debug_list, opt, packed_input):
        loss, lse, alpha, beta, lengths = loss_and_saved(x, label, f_len, y_len, batch_offset, max_f_len,
                                                         blank_idx, debug_list, opt, packed_input)
        # The Triton path saves the labels and lengths as its kernels read them, so that its backward (same
        # path: the backend is chosen once) launches without converting them again.
        sizes = None
        if lengths is not None:
            label, f_len, y_len, sizes = lengths
        # (one attribute: each costs a dictionary entry on the context, set and read; sizes: the usual dense
        # Triton call's, which its backward launches with)
        ctx.args = sizes, blank_idx, fuse_softmax_backward, packed_input
        if sizes is not None and fuse_softmax_backward:
            ctx.save_for_backward(x, lse, alpha, beta, f_len, y_len, label)
        else:
            ctx.save_for_backward(x, lse, alpha, beta, f_len, y_len, label, batch_offset)
        return loss

    @staticmethod
    def backward(ctx, loss_grad):
        sizes, blank_idx, fused, packed_input = ctx.args
        if sizes is not None and fused:
            # alpha, beta and lse as the forward's kernels wrote them (contiguous), the labels and lengths as
            # they read them: only x and the incoming gradient may need a copy, unless a saved-tensor hook gave
            # the others back in another layout (the kernels read them contiguous).
            x, lse, alpha, beta, f_len, y_len, label = ctx.saved_tensors
            if not (lse.is_contiguous() and alpha.is_contiguous() and beta.is_contiguous()
                    and label.is_contiguous()):
                lse, alpha, beta, label = lse.contiguous(), alpha.contiguous(), beta.contiguous(), label.contiguous()
            return (_kernels().grad_dense(x.contiguous(), lse, loss_grad.contiguous(), alpha, beta, label, f_len,
                                          y_len, *sizes, blank_idx), *_NO_GRADS)
        x, lse, alpha, beta, f_len, y_len, label, batch_offset = ctx.saved_tensors
        dx = gradient(x, loss_grad, lse, alpha, beta, label, f_len, y_len, batch_offset, blank_idx, fused,
                      packed_input)
        return (dx, *_NO_GRADS)


def gradient(x, loss_grad, lse, alpha, beta, label, f_len, y_len, batch_offset, blank_idx, fused, packed_input
             ) -> Tensor:
    """The logits' gradient from :func:`loss_and_saved`'s ``lse``, ``alpha`` and ``beta``."""
    if fused:
        return loss_backward(x, loss_grad, alpha, beta, f_len, y_len, label, batch_offset, blank_idx, True,
                             packed_input, lse=lse)
    # the sparse gradient of the log-probabilities, then the log-softmax backward (in fp32)
    acc = alpha.dtype
    dlp = loss_backward(x, loss_grad, alpha, beta, f_len, y_len, label, batch_offset, blank_idx, False,
                        packed_input, out_dtype=acc, lse=lse)
    prob = torch.softmax(x.to(acc), dim=-1)
    return dlp.sub_(prob.mul_(dlp.sum(-1, keepdim=True))).to(x.dtype)


# The planned eager Triton path of dense logits (apex.ops._transducer_direct): a call whose layout was checked
# before takes its plan; None where this module's general path takes the call.
_lean = LossLean(_kernels, gradient).run

_traced = lazy_module("apex.ops._transducer_traced")


def traced_apply(*args) -> Tensor:
    """:class:`TransducerLossFunc`'s ``apply``, or its custom ops while ``torch.compile`` or ``torch.export``
    traces (the Function's Python cannot be traced in one graph: see :mod:`apex.ops._transducer_traced`)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return _traced().loss(*args)
    return TransducerLossFunc.apply(*args)


def transducer_loss(x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, blank_idx: int,
                    batch_offset: Tensor | None = None, max_f_len: int | None = None, packed_input: bool = False,
                    fuse_softmax_backward: bool = True, debug_list: list | None = None) -> Tensor:
    """Per-sequence RNN-T loss (B,) of logits ``x`` with autograd; see the module docstring."""
    if not packed_input:
        loss = _lean(x, label, f_len, y_len, blank_idx, fuse_softmax_backward, debug_list, 1)
        if loss is not None:
            return loss
        max_f_len = x.shape[1] if isinstance(x, Tensor) and x.dim() == 4 else None
    return traced_apply(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, fuse_softmax_backward,
                        debug_list, 1, packed_input)


# ------------------------------------------------------------------- compat: transducer_loss_cuda.*
def forward(x, label, fLen, yLen, batchOffset, maxFLen, blankIdx, opt, packedInput):  # noqa: N803
    """``transducer_loss_cuda.forward`` on log-probabilities ``x``: ``[alpha, beta, loss]``."""
    _check_opt(opt)
    alpha, beta, loss = loss_forward(x, label, fLen, yLen, batchOffset if packedInput else None,
                                     maxFLen, int(blankIdx), bool(packedInput))
    return [alpha, beta, loss]


def backward(x, lossGrad, alpha, beta, fLen, yLen, label, batchOffset, maxFLen, blankIdx, opt,
             fuseSoftmaxBackward, packedInput):  # noqa: N803
    """``transducer_loss_cuda.backward``: the gradient of the logits (fused) or of the log-probabilities."""
    return loss_backward(x, lossGrad, alpha, beta, fLen, yLen, label, batchOffset, int(blankIdx),
                         bool(fuseSoftmaxBackward), bool(packedInput))
