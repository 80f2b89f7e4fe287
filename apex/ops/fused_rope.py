"""Rotary positional embedding, rotate-half form, on the first ``R`` columns of the head dimension.

For angles ``f`` (``freqs``) or cached ``cos``/``sin`` of ``R`` columns and ``rotate_half(x) = [−x₂, x₁]``:
``y[..., :R] = x[..., :R]·cos + rotate_half(x[..., :R])·sin`` and ``y[..., R:] = x[..., R:]``. The backward
is the transpose rotation (``dx = dy·cos − rotate_half(dy·sin)``); the tables get no gradient.

Layouts: ``sbhd`` (``[s, b, h, d]`` with tables ``[s, 1, 1, R]``: as Apex, the same sequence length),
``thd`` (packed sequences ``[t, h, d]`` with ``cu_seqlens``: token ``i`` of sequence ``k`` has position
``i − cu_seqlens[k]``; ``freqs`` ``[max_s, 1, 1, R]``), and the 2-D image variant (``[b, img_h·img_w, h, d]``;
the first ``d/2`` columns rotated by the row's height index, the rest by its width index; tables
``[1, ≥img_h (≥img_w), 1, d/2]``). Inputs may have any strides. ``freqs`` is fp32 (fp64 for fp64 inputs);
cached ``cos``/``sin`` tables are fp32 or the input's dtype.

Dtype policy: fp32 inputs compute in fp32 (fp64 in fp64). fp16/bf16 inputs follow upstream's arithmetic
exactly: the cos/sin values are rounded to the input dtype, and each product and the sum are rounded to it
(what upstream's CUDA kernel and its unfused PyTorch formula both do), so results agree with upstream's
bit for bit rather than being one rounding more accurate (bf16: about 1.65x the relative error of the fp32
formula rounded once, and Apex's own test, which compares with that unfused formula at the dtype's default
tolerances, fails for a once-rounded result). Output layout: contiguous, or ``[b, s, h, d]``
memory seen as ``[s, b, h, d]`` with ``transpose_output_memory=True`` (also for the gradient, as upstream).

Errors name the argument: a wrong shape or value is a ``ValueError``, a wrong type or dtype a ``TypeError``,
and each is also the ``RuntimeError`` Apex's ``TORCH_CHECK`` raised (the 2-D form's sequence length and
table pairs: also the ``AssertionError`` of Apex's ``assert``).

Paths, behind the ``apex::fused_rope`` custom op: CUDA/ROCm tensors run one Triton launch each way
(``apex._kernels.fused_rope``); CPU tensors four fused multiply-adds on the two halves, written straight
into the output.
"""

from __future__ import annotations

import torch
from torch._C import _any_requires_grad, _are_functorch_transforms_active, _is_tracing
from torch._C import _len_torch_dispatch_stack as _dispatch_modes

from apex._backend import select_tensor
from apex.ops._dispatch import _PLAIN, _PLAIN_OR_NONE, custom_op, lazy_module

# The argument checks (apex.ops._fused_rope_checks), each also importable from here, where callers look for them.
from apex.ops._fused_rope_checks import (  # noqa: F401
    _FLOATS,
    _check_cu_values,
    _check_freqs_dtype,
    _check_pair,
    _check_table,
    _check_table_dtype,
    _check_tensor,
    check_2d,
    check_cached,
    check_sbhd,
    check_thd,
)
from apex.ops._rope_direct import Lean

Tensor = torch.Tensor
_kernels = lazy_module("apex._kernels.fused_rope")

SBHD, CACHED, THD, IMG2D = 0, 1, 2, 3


# ------------------------------------------------------------------------------------------ torch path
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32, fp64 for fp64; fp16/bf16 compute in their own dtype, as upstream (see the docstring)."""
    return torch.float64 if dtype == torch.float64 else dtype if dtype in (torch.float16, torch.bfloat16) \
        else torch.float32


def _rotate(x: Tensor, c: Tensor, s: Tensor, out: Tensor, backward: bool) -> None:
    """``out = x·c + rotate_half(x)·s`` (forward) or its transpose, half by half, into ``out``."""
    h = x.shape[-1] // 2
    if h == 0:
        return
    x1, x2, c1, c2, s1, s2 = x[..., :h], x[..., h:], c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    if backward:  # dx1 = g1·c1 + g2·s2 ; dx2 = g2·c2 − g1·s1
        terms = ((x1, c1, x2, s2, 1), (x2, c2, x1, s1, -1))
    else:  # y1 = x1·c1 − x2·s1 ; y2 = x2·c2 + x1·s2
        terms = ((x1, c1, x2, s1, -1), (x2, c2, x1, s2, 1))
    for (a, ca, b, sb, sign), o in zip(terms, (out[..., :h], out[..., h:])):
        torch.mul(a, ca, out=o)
        if o.dtype in (torch.float16, torch.bfloat16):
            o.add_(torch.mul(b, sb), alpha=sign)  # each product rounded, as upstream's kernel
        else:
            o.addcmul_(b, sb, value=sign)


def _thd_tables(freqs2: Tensor, cu: Tensor, tokens: int, cd: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per-token cos/sin ``[t, 1, R]`` from the positions ``i − cu_seqlens[k]`` (identity outside)."""
    cu64 = cu.to(torch.int64)
    idx = torch.arange(tokens, device=cu.device)
    seq = torch.searchsorted(cu64[1:], idx, right=True)
    valid = (idx >= cu64[0]) & (idx < cu64[-1])
    pos = torch.where(valid, idx - cu64[seq.clamp_(max=cu64.numel() - 1)], 0)
    f = _angles(freqs2, cd)[pos]
    v = valid.unsqueeze(1)
    return (torch.where(v, f.cos(), 1.0).to(cd).unsqueeze(1), torch.where(v, f.sin(), 0.0).to(cd).unsqueeze(1))


def _angles(freqs: Tensor, cd: torch.dtype) -> Tensor:
    """Angles in fp32 (fp64 for fp64 inputs): cos/sin are taken there, then rounded to ``cd``."""
    return freqs.to(torch.float64 if cd == torch.float64 else torch.float32)


def _torch_path(t, y, ta, tb, tc, td, cu, mode, img_w, backward):
    cd = _compute_dtype(t.dtype)
    if mode == IMG2D:
        b, s, h, d = t.shape
        ih, r = s // img_w, d // 2
        x5, y5 = t.reshape(b, ih, img_w, h, d), y.view(b, ih, img_w, h, d)
        ch, sh = ta[:, :ih].to(cd).unsqueeze(2), tb[:, :ih].to(cd).unsqueeze(2)
        cw, sw = tc[:, :img_w].to(cd).unsqueeze(1), td[:, :img_w].to(cd).unsqueeze(1)
        _rotate(x5[..., :r], ch, sh, y5[..., :r], backward)
        _rotate(x5[..., r:], cw, sw, y5[..., r:], backward)
        return y
    if mode == THD:
        r = ta.size(3)
        c, s = _thd_tables(ta[:, 0, 0, :], cu, t.size(0), cd)
    elif mode == SBHD:
        r = ta.size(3)
        f = _angles(ta[: t.size(0)], cd)
        c, s = f.cos().to(cd), f.sin().to(cd)
    else:
        r = ta.size(3)
        c, s = ta[: t.size(0)].to(cd), tb[: t.size(0)].to(cd)
    _rotate(t[..., :r], c, s, y[..., :r], backward)
    if r < t.size(-1):
        y[..., r:].copy_(t[..., r:])
    return y


# ------------------------------------------------------------------------------------ dispatch (no grad)
def _alloc(t: Tensor, mode: int, transpose_output: bool) -> Tensor:
    if mode in (SBHD, CACHED) and transpose_output:
        s, b, h, d = t.shape
        return torch.empty(b, s, h, d, dtype=t.dtype, device=t.device).transpose(0, 1)
    # empty_like, not new_empty(t.shape): a torch.Size argument costs ~2 µs more to parse.
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def rope_apply(t: Tensor, ta: Tensor, tb: Tensor | None, tc: Tensor | None, td: Tensor | None,
               cu_seqlens: Tensor | None, mode: int, img_w: int, backward: bool,
               transpose_output: bool) -> Tensor:
    """The rotation (or its transpose when ``backward``) without autograd; arguments already checked."""
    if mode == THD:
        _check_cu_values(cu_seqlens, t.size(0), ta.size(0))
    return _rotated(t, ta, tb, tc, td, cu_seqlens, mode, img_w, backward, transpose_output)


def _rotated(t: Tensor, ta: Tensor, tb: Tensor | None, tc: Tensor | None, td: Tensor | None,
             cu_seqlens: Tensor | None, mode: int, img_w: int, backward: bool, transpose_output: bool) -> Tensor:
    """:func:`rope_apply` with ``cu_seqlens``' values already checked (the forward checked them, and the
    backward's saved tables and offsets are version-checked by autograd: no second host read)."""
    y = _alloc(t, mode, transpose_output)
    # fp64 stays on the PyTorch path: the kernel computes in fp32.
    # The op's function runs on real tensors (torch.compile records the op, not this code): the eager select.
    if t.dtype != torch.float64 and select_tensor(t) == "triton":
        kernels = _kernels()
        if mode == IMG2D:  # [b, s, h, d] seen as [s, b, h, d]; tables [1, rows, 1, R] as [rows, R]
            x4, y4, r = t.transpose(0, 1), y.transpose(0, 1), t.size(3) // 2
            dims = (1, 3)
        else:
            x4 = t.unsqueeze(1) if mode == THD else t
            y4 = y.unsqueeze(1) if mode == THD else y
            r = ta.shape[3]
            dims = (0, 3)  # [rows, 1, 1, R]
        kernels.rope(x4, y4, mode, backward, r, ta, tb, tc, td, cu_seqlens, img_w, dims)
        return y
    return _torch_path(t, y, ta, tb, tc, td, cu_seqlens, mode, img_w, backward)


# ------------------------------------------------------------------------------------------- custom op
@custom_op("apex::fused_rope")
def _rope_op(t: Tensor, ta: Tensor, tb: Tensor | None, tc: Tensor | None, td: Tensor | None,
             cu_seqlens: Tensor | None, mode: int, img_w: int, backward: bool, transpose_output: bool
             ) -> Tensor:
    return rope_apply(t, ta, tb, tc, td, cu_seqlens, mode, img_w, backward, transpose_output)


@_rope_op.register_fake
def _(t, ta, tb, tc, td, cu_seqlens, mode, img_w, backward, transpose_output):
    return _alloc(t, mode, transpose_output)


def _setup(ctx, inputs, output):
    t, ta, tb, tc, td, cu, mode, img_w, backward, transpose_output = inputs
    ctx.args = (mode, img_w, not backward, transpose_output)
    ctx.save_for_backward(ta, tb, tc, td, cu)


def _backward(ctx, grad):
    ta, tb, tc, td, cu = ctx.saved_tensors
    dt = _rope_op(grad, ta, tb, tc, td, cu, *ctx.args)
    return dt, None, None, None, None, None, None, None, None, None


_rope_op.register_autograd(_backward, setup_context=_setup)


def _grad_rotated(grad: Tensor, ta: Tensor, tb: Tensor | None, tc: Tensor | None, td: Tensor | None,
                  cu: Tensor | None, mode: int, img_w: int, transpose_output: bool) -> Tensor:
    """The eager backward: the transpose rotation itself, or ``_rope_op`` wherever the registered op is needed
    (a graph for a second derivative, a dispatch mode, a ``torch.func`` transform, a tensor subclass)."""
    if (torch.is_grad_enabled() or type(grad) not in _PLAIN or torch.compiler.is_compiling()
            or torch.compiler.is_exporting() or _dispatch_modes() or _are_functorch_transforms_active()
            or _is_tracing()):
        return _rope_op(grad, ta, tb, tc, td, cu, mode, img_w, True, transpose_output)
    return _rotated(grad, ta, tb, tc, td, cu, mode, img_w, True, transpose_output)


class _Direct(torch.autograd.Function):
    """The eager call with a gradient on plain tensors: what ``_rope_op``'s eager call does through its
    function, setup and backward op, without those layers (backward: :func:`_grad_rotated`)."""

    @staticmethod
    def forward(ctx, t, ta, tb, tc, td, cu, mode, img_w, transpose_output):
        ctx.save_for_backward(ta, tb, tc, td, cu)
        ctx.args = (mode, img_w, transpose_output)
        return _rotated(t, ta, tb, tc, td, cu, mode, img_w, False, transpose_output)

    @staticmethod
    def backward(ctx, grad):
        ta, tb, tc, td, cu = ctx.saved_tensors
        dt = _grad_rotated(grad, ta, tb, tc, td, cu, *ctx.args)
        return dt, None, None, None, None, None, None, None, None


class _DirectSBHD(torch.autograd.Function):
    """:class:`_Direct` for the usual call (``freqs``, ``sbhd``): three arguments and one saved table instead of
    nine and five (each argument and saved slot costs the C++ ``apply`` and the backward ~1,000 instructions),
    and a backward that launches with the forward's kernels module (or the PyTorch path where the forward took
    it) instead of choosing the backend and loading the module again."""

    @staticmethod
    def forward(ctx, t, freqs, transpose_output, r):
        ctx.save_for_backward(freqs)
        y = _alloc(t, SBHD, True) if transpose_output else torch.empty_like(t, memory_format=_CONTIGUOUS)
        if t.dtype is not torch.float64 and select_tensor(t) == "triton":  # (fp64: the PyTorch path)
            # Never while tracing (the entry routed that to _rope_op): the loaded module without _kernels' query.
            kernels = _LOADED[0] if _LOADED else _load()
            kernels.rope(t, y, SBHD, False, r, freqs, None, None, None, None, 1, (0, 3))
        else:
            kernels = None
            _torch_path(t, y, freqs, None, None, None, None, SBHD, 1, False)
        ctx.args = (transpose_output, kernels, r)
        return y

    @staticmethod
    def backward(ctx, grad):
        freqs, = ctx.saved_tensors
        transpose_output, kernels, r = ctx.args
        # (torch.compiler.is_exporting() implies is_compiling(): torch.export sets both flags)
        if (torch.is_grad_enabled() or type(grad) not in _PLAIN or torch.compiler.is_compiling()
                or _dispatch_modes() or _are_functorch_transforms_active() or _is_tracing()):
            dt = _rope_op(grad, freqs, None, None, None, None, SBHD, 1, True, transpose_output)
        else:
            dt = _alloc(grad, SBHD, True) if transpose_output else torch.empty_like(grad, memory_format=_CONTIGUOUS)
            if kernels is not None:
                kernels.rope(grad, dt, SBHD, True, r, freqs, None, None, None, None, 1, (0, 3))
            else:
                _torch_path(grad, dt, freqs, None, None, None, None, SBHD, 1, True)
        return dt, None, None, None


_CONTIGUOUS = torch.contiguous_format
_LOADED: list = []  # the kernels' module, once _DirectSBHD has loaded it


def _load():
    _LOADED.append(_kernels())
    return _LOADED[0]


_direct = super(torch.autograd.Function, _Direct).apply  # the C++ apply, as apex.ops._dispatch's
_direct_sbhd = super(torch.autograd.Function, _DirectSBHD).apply


def _run(t: Tensor, ta: Tensor, tb: Tensor | None, tc: Tensor | None, td: Tensor | None, cu: Tensor | None,
         mode: int, img_w: int, transpose_output: bool) -> Tensor:
    """A checked call: the registered op while compiling, exporting or tracing, under a dispatch mode or a
    ``torch.func`` transform, or for a tensor subclass (each sees it as before); otherwise :class:`_Direct`
    when a gradient is needed, or the rotation alone (the custom op's eager call without its layers)."""
    if (torch.compiler.is_compiling() or torch.compiler.is_exporting() or _dispatch_modes()
            or _are_functorch_transforms_active() or _is_tracing() or type(t) not in _PLAIN
            or type(ta) not in _PLAIN or type(tb) not in _PLAIN_OR_NONE or type(tc) not in _PLAIN_OR_NONE
            or type(td) not in _PLAIN_OR_NONE or type(cu) not in _PLAIN_OR_NONE):
        return _rope_op(t, ta, tb, tc, td, cu, mode, img_w, False, transpose_output)
    if mode == THD:
        _check_cu_values(cu, t.size(0), ta.size(0))
    if torch.is_grad_enabled() and _any_requires_grad(t, ta, tb, tc, td):
        return _direct(t, ta, tb, tc, td, cu, mode, img_w, transpose_output)
    return _rotated(t, ta, tb, tc, td, cu, mode, img_w, False, transpose_output)


# ------------------------------------------------------------------------------------- autograd entry
# The planned eager Triton path (apex.ops._rope_direct): a call whose layout was checked before launches from
# its plan; None for anything else (the general path below, its checks and errors).
_lean = Lean(_kernels, check_sbhd, _rope_op).run


def fused_rope(t: Tensor, freqs: Tensor, transpose_output_memory: bool = False) -> Tensor:
    """RoPE on ``t`` ``[s, b, h, d]`` with fp32 angles ``freqs`` ``[s, 1, 1, R]``, ``R ≤ d`` even."""
    out = _lean(t, freqs, transpose_output_memory)
    if out is not None:
        return out
    tr = bool(transpose_output_memory)
    # Plain tensors (check_sbhd's quick test) in eager mode: _run's routing with two tensors and no cu_seqlens.
    # (torch.compiler.is_exporting() implies is_compiling(): torch.export sets both flags)
    r = check_sbhd(t, freqs)
    if (r < 0 or torch.compiler.is_compiling() or _dispatch_modes() or _are_functorch_transforms_active()
            or _is_tracing()):
        return _run(t, freqs, None, None, None, None, SBHD, 1, tr)
    if torch.is_grad_enabled() and _any_requires_grad(t, freqs):
        return _direct_sbhd(t, freqs, tr, r)
    return _rotated(t, freqs, None, None, None, None, SBHD, 1, False, tr)


def fused_rope_cached(t: Tensor, cos_: Tensor, sin_: Tensor, transpose_output_memory: bool = False) -> Tensor:
    """RoPE on ``t`` ``[s, b, h, d]`` with precomputed ``cos_``/``sin_`` ``[s, 1, 1, R]`` (fp32 or ``t``'s dtype)."""
    check_cached(t, cos_, sin_)
    return _run(t, cos_, sin_, None, None, None, CACHED, 1, bool(transpose_output_memory))


def fused_rope_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """RoPE on packed sequences ``t`` ``[t, h, d]``; ``cu_seqlens`` ``[n + 1]`` non-decreasing."""
    check_thd(t, cu_seqlens, freqs)
    return _run(t, freqs, None, None, None, cu_seqlens, THD, 1, False)


def fused_rope_2d(t: Tensor, img_h: int, img_w: int, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor,
                  sin_w: Tensor) -> Tensor:
    """2-D RoPE on ``t`` ``[b, img_h·img_w, h, d]`` with tables ``[1, ≥img_h (≥img_w), 1, d/2]``."""
    check_2d(t, img_h, img_w, cos_h, sin_h, cos_w, sin_w)
    return _run(t, cos_h, sin_h, cos_w, sin_w, None, IMG2D, int(img_w), False)


# ------------------------------------------- Apex's ``fused_rotary_positional_embedding`` entry points
def forward(input: Tensor, freqs: Tensor, transpose_output: bool) -> Tensor:
    """Upstream's ``fused_rotary_positional_embedding.forward(input, freqs, transpose_output)``: rotate-half
    RoPE of an ``[s, b, h, d]`` tensor by ``freqs`` ``[s, 1, 1, R]`` (the first ``R`` columns rotate).
    """
    check_sbhd(input, freqs, "input")
    return rope_apply(input, freqs, None, None, None, None, SBHD, 1, False, transpose_output)


def backward(output_grads: Tensor, freqs: Tensor, transpose_output: bool) -> Tensor:
    """The gradient of :func:`forward`: the inverse rotation of ``output_grads``."""
    check_sbhd(output_grads, freqs, "output_grads")
    return rope_apply(output_grads, freqs, None, None, None, None, SBHD, 1, True, transpose_output)


def forward_cached(input: Tensor, cos: Tensor, sin: Tensor, transpose_output: bool) -> Tensor:
    """RoPE with precomputed ``cos``/``sin`` of shape ``[s, 1, 1, R]`` (upstream's ``forward_cached``)."""
    check_cached(input, cos, sin, "input", ("cos", "sin"))
    return rope_apply(input, cos, sin, None, None, None, CACHED, 1, False, transpose_output)


def backward_cached(output_grads: Tensor, cos: Tensor, sin: Tensor, transpose_output: bool) -> Tensor:
    """The gradient of :func:`forward_cached`."""
    check_cached(output_grads, cos, sin, "output_grads", ("cos", "sin"))
    return rope_apply(output_grads, cos, sin, None, None, None, CACHED, 1, True, transpose_output)


def forward_thd(input: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """RoPE of packed sequences ``[t, h, d]``: positions restart at each ``cu_seqlens`` boundary."""
    check_thd(input, cu_seqlens, freqs, "input")
    return rope_apply(input, freqs, None, None, None, cu_seqlens, THD, 1, False, False)


def backward_thd(output_grads: Tensor, cu_seqlens: Tensor, freqs: Tensor) -> Tensor:
    """The gradient of :func:`forward_thd`."""
    check_thd(output_grads, cu_seqlens, freqs, "output_grads")
    return rope_apply(output_grads, freqs, None, None, None, cu_seqlens, THD, 1, True, False)


def _img(x: Tensor, name: str) -> tuple[Tensor, int, int]:
    _check_tensor(x, name, 5)
    b, ih, iw, h, d = x.shape
    return x.reshape(b, ih * iw, h, d), ih, iw


def forward_2d(input: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor) -> Tensor:
    """``input`` ``[b, img_h, img_w, h, d]`` → ``[b, img_h·img_w, h, d]``."""
    t, ih, iw = _img(input, "input")
    check_2d(t, ih, iw, cos_h, sin_h, cos_w, sin_w, "input")
    return rope_apply(t, cos_h, sin_h, cos_w, sin_w, None, IMG2D, iw, False, False)


def backward_2d(output_grads: Tensor, cos_h: Tensor, sin_h: Tensor, cos_w: Tensor, sin_w: Tensor) -> Tensor:
    """The gradient of the 2-D (image) RoPE ``forward_2d``: height and width rotations inverted."""
    g, ih, iw = _img(output_grads, "output_grads")
    check_2d(g, ih, iw, cos_h, sin_h, cos_w, sin_w, "output_grads")
    return rope_apply(g, cos_h, sin_h, cos_w, sin_w, None, IMG2D, iw, True, False)
