"""RNN-T joint: ``h[b, t, u, :] = f[b, t, :] + g[b, u, :]`` for ``t < f_len[b]``, ``u < g_len[b]``.

Optional ReLU and dropout are fused in (``mask`` records which elements survived, ``h = (f + g)·mask·s``
with ``s = 1/(1 − dropout_prob)`` under dropout). Dense output is (B, T, U, H) with the don't-care region
(``t ≥ f_len`` or ``u ≥ g_len``) set to −1 as Apex does; packed output is (Σ f_len·g_len, H), batch element
``b`` starting at row ``batch_offset[b − 1]`` (``batch_offset = cumsum(f_len·g_len)``).

Dtype policy: the sum is rounded once to the input dtype (the PyTorch path adds in the input dtype, the
Triton kernel in fp32); the backward sums gradients in fp32 and rounds once to the input dtype. Gradients
outside the lengths are zero.

Paths: CUDA/ROCm tensors run the Triton kernels of ``apex._kernels.transducer_joint``; CPU tensors run a
broadcast add and boolean-mask packing in PyTorch. Dropout draws different random numbers on the two paths.
On the Triton path a dense output's eager calls take a plan per argument layout (:mod:`apex.ops._transducer_direct`:
the same launches, less host time per call).
"""

from __future__ import annotations

import torch

from apex import _backend
from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._checks import member_set
from apex.ops._dispatch import kept_per_key, lazy_module
from apex.ops._norm import _same_device, check_devices
from apex.ops._transducer_direct import JointLean

# The Triton path's kernels read the lengths and mask next to f (the PyTorch path compares lengths on their own
# device): one of another device is refused naming it.
_TRITON_DEVICES = {"error": RuntimeValueError, "optional": True, "note": " (the Triton path needs them on one device)"}

Tensor = torch.Tensor


_FLOATS = member_set(torch.float32, torch.float16, torch.bfloat16, torch.float64)
_INTS = member_set(torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8)


def _check(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, dropout_prob, ranges: bool = True):
    # ranges=False (a dense output on the Triton path, whose kernels check the lengths themselves): shapes,
    # dtypes and arguments only, no host read of the lengths (a GPU synchronisation per call).
    # The usual call (dense output, 3-D f and g of one float dtype and batch, integer lengths of that batch on
    # one device, in range) is tested first, reading each attribute once; anything else takes the checks
    # below, which word the error (lengths out of range go straight to the read of their extremes).
    if (not pack_output and isinstance(f, Tensor) and isinstance(g, Tensor) and isinstance(f_len, Tensor)
            and isinstance(g_len, Tensor) and 0.0 <= dropout_prob < 1.0):
        fs, gs, ls = f.shape, g.shape, f_len.shape
        dtype = f.dtype
        if (len(fs) == 3 and len(gs) == 3 and len(ls) == 1 and gs[0] == ls[0] == fs[0] > 0 and gs[2] == fs[2]
                and g_len.shape == ls and dtype in _FLOATS and g.dtype == dtype and f_len.dtype in _INTS
                and g_len.dtype in _INTS and f_len.device == g_len.device):
            if ranges and not _in_bounds(f_len, g_len, fs[1], gs[1]):
                _range_error(f_len, g_len, fs[1], gs[1])
            return
    # Where Apex's transducer_joint_cuda raised RuntimeError (the dtypes it dispatched on, opt and the tile size
    # below), the error is also a RuntimeError.
    for name, t in (("f", f), ("g", g)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor (B, {'T' if name == 'f' else 'U'}, H), got "
                             f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
        if not t.is_floating_point():
            raise RuntimeTypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    B, T, H = f.shape
    if g.shape[0] != B or g.shape[2] != H or g.dtype != f.dtype:
        raise RuntimeValueError(f"g has shape {tuple(g.shape)} and dtype {g.dtype}; expected ({B}, U, {H}) and "
                                f"{f.dtype}")
    for name, t in (("f_len", f_len), ("g_len", g_len)):
        if not isinstance(t, Tensor) or t.dim() != 1 or t.shape[0] != B or t.is_floating_point():
            raise ValueError(f"{name} must be a 1-D integer tensor of {B} lengths")
    # (devices compared by flags and index: no torch.device objects built)
    if B and (ranges or pack_output) and (not _same_device(f_len, g_len)
                                          or not _in_bounds(f_len, g_len, T, g.shape[1])):
        _range_error(f_len, g_len, T, g.shape[1])
    if not 0.0 <= dropout_prob < 1.0:
        raise ValueError(f"dropout_prob must be in [0, 1), got {dropout_prob}")
    if pack_output:
        if batch_offset is None or not isinstance(batch_offset, Tensor) or batch_offset.shape != (B,):
            raise ValueError(f"batch_offset must be a tensor of {B} cumulative row counts when packing")
        expect = torch.cumsum(f_len.long() * g_len.long(), 0)
        if not torch.equal(batch_offset.long().cpu(), expect.cpu()):
            raise ValueError("batch_offset must equal cumsum(f_len * g_len)")
        total = int(expect[-1]) if B else 0
        if int(packed_batch) != total:
            raise ValueError(f"packed_batch must be the packed row count {total}, got {int(packed_batch)}")


def _range_error(f_len: Tensor, g_len: Tensor, T: int, U: int) -> None:
    """Raises the message naming the length out of range (or returns, the lengths living apart but in range):
    both lengths' extremes in one host read where they share a device."""
    if f_len.device == g_len.device:
        extremes = torch.stack((*f_len.aminmax(), *g_len.aminmax())).tolist()
    else:
        extremes = torch.stack(f_len.aminmax()).tolist() + torch.stack(g_len.aminmax()).tolist()
    for name, lo, hi, cap in (("f_len", *extremes[:2], T), ("g_len", *extremes[2:], U)):
        if lo < 0 or hi > cap:
            raise ValueError(f"{name} values must lie in [0, {cap}], got [{lo}, {hi}]")


def _in_bounds(f_len: Tensor, g_len: Tensor, T: int, U: int) -> bool:
    """Whether ``0 ≤ f_len ≤ T`` and ``0 ≤ g_len ≤ U``: both lengths clamped to their bounds at once and
    compared with themselves, three small operators and one host read (``torch.equal``; a GPU
    synchronisation) instead of two ``aminmax``, a stack and a transfer."""
    values = torch.cat((f_len, g_len))
    lo, hi = _bounds(f_len.shape[0], T, U, values.dtype, values.device)
    return torch.equal(values.clamp(lo, hi), values)


@kept_per_key
def _bounds(B: int, T: int, U: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`_in_bounds`'s bounds, kept per sizes, dtype and device."""
    top = torch.iinfo(dtype).max  # (a bound past the dtype's range is no bound)
    return (torch.zeros(2 * B, dtype=dtype, device=device),
            torch.tensor([min(T, top)] * B + [min(U, top)] * B, dtype=dtype, device=device))


def _valid(f_len, g_len, T, U):
    t = torch.arange(T, device=f_len.device)
    u = torch.arange(U, device=f_len.device)
    return (t.view(1, T, 1) < f_len.view(-1, 1, 1)) & (u.view(1, 1, U) < g_len.view(-1, 1, 1))


def _forward_torch(f, g, f_len, g_len, pack_output, relu, dropout, dropout_prob):
    B, T, H = f.shape
    U = g.shape[1]
    h = f.unsqueeze(2) + g.unsqueeze(1)
    valid = _valid(f_len, g_len, T, U)
    keep = None
    if relu:
        h.relu_()
        keep = h > 0  # where the sum was positive (a zero sum has a zero gradient either way)
    if dropout:
        kept = torch.rand(h.shape, device=h.device) < 1.0 - dropout_prob
        keep = kept if keep is None else keep.logical_and_(kept)
        h = torch.where(keep, h.float() / (1.0 - dropout_prob), 0.0).to(f.dtype)
    mask = keep.view(torch.uint8) if keep is not None else None  # bool and uint8 share the byte layout
    if pack_output:
        return h[valid], (mask[valid] if mask is not None else None)
    # Only the don't-care rows are touched (an index_put over them, not a pass over all of h).
    invalid = ~valid
    h[invalid] = -1.0
    if mask is not None:
        mask[invalid] = 0
    return h, mask


def _backward_torch(dh, mask, f_len, g_len, T, U, pack_output, scale):
    B = f_len.shape[0]
    H = dh.shape[-1]
    valid = _valid(f_len, g_len, T, U)
    if pack_output:
        grid = dh.new_zeros((B, T, U, H))
        grid[valid] = dh if mask is None else dh * mask.to(dh.dtype)
    elif mask is None:
        grid = dh * valid.unsqueeze(-1)
    else:  # the forward zeroed the mask outside the lengths
        grid = dh * mask
    if scale != 1.0:
        grid = grid * scale
    df = grid.sum(2, dtype=torch.float32).to(dh.dtype)
    dg = grid.sum(1, dtype=torch.float32).to(dh.dtype)
    return df, dg


_KERNELS: list = []


def _kernels():
    """``apex._kernels.transducer_joint``, imported on first use (an import statement costs ~1 µs a call)."""
    if not _KERNELS:
        from apex._kernels import transducer_joint

        _KERNELS.append(transducer_joint)
    return _KERNELS[0]


# The planned eager Triton path of a dense output (apex.ops._transducer_direct): a call whose layout and options
# were checked before takes its plan; None where this module's general path takes the call.
_lean = JointLean(_kernels).run


def _int32(t: Tensor) -> Tensor:
    # The kernels read contiguous int32 lengths; the usual ones are already (a no-op .to is still a call).
    return (t if t.dtype == torch.int32 else t.to(torch.int32)).contiguous()


def joint_forward(f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None = None,
                  packed_batch: int = 0, pack_output: bool = False, relu: bool = False, dropout: bool = False,
                  dropout_prob: float = 0.0, tile_size: int = 4) -> tuple[Tensor, Tensor | None]:
    """``(h, mask)`` without autograd (``mask`` is None unless ReLU or dropout is on)."""
    h, mask, _ = joint_forward_saved(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout,
                                     dropout_prob, tile_size)
    return h, mask


def joint_forward_saved(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout, dropout_prob,
                        tile_size):
    """:func:`joint_forward`'s ``(h, mask)`` and, on the Triton path, ``(f_len, g_len, batch_offset, sizes)``:
    the lengths and offsets as its kernels read them, and ``(B, T, U, H)`` for a dense output (None otherwise);
    None on the PyTorch path. The Function saves those for its backward."""
    if not pack_output and isinstance(f, Tensor) and _backend.select_tensor(f) == "triton":
        out = _usual_dense(f, g, f_len, g_len, relu, dropout, dropout_prob, tile_size)
        if out is not None:
            return out
    # (f decides the backend, as select(f, g) did: no search of the arguments)
    triton = isinstance(f, Tensor) and _backend.select_tensor(f) == "triton"
    _check(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, dropout_prob if dropout else 0.0,
           not triton)
    if tile_size not in (1, 2, 4):
        raise RuntimeValueError(f"fwd_tile_size must be 1, 2 or 4, got {tile_size}")
    if triton:
        check_devices(f, ("g", g), ("f_len", f_len), ("g_len", g_len), what="f", **_TRITON_DEVICES)
        kernels = _kernels()
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout else 0
        boff = batch_offset.to(f.device, torch.int64).contiguous() if pack_output else None
        f32, g32 = _int32(f_len), _int32(g_len)
        h, mask = kernels.forward(f.contiguous(), g.contiguous(), f32, g32, boff, int(packed_batch), pack_output,
                                  relu, dropout, dropout_prob, tile_size, seed)
        return h, mask, (f32, g32, boff, None)
    return (*_forward_torch(f, g, f_len, g_len, pack_output, relu, dropout, dropout_prob), None)


def _usual_dense(f, g, f_len, g_len, relu, dropout, dropout_prob, tile_size) -> tuple | None:
    """The Triton path of the usual dense call, :func:`joint_forward_saved`'s answer: 3-D ``f`` and ``g`` of
    one float dtype and batch, 1-D integer lengths of that batch on one device, valid options; None for any
    other call (the full checks then word the error). Each fact is read once, the sizes go to the launcher
    as integers; the lengths' ranges are checked in the kernels."""
    if not (isinstance(g, Tensor) and isinstance(f_len, Tensor) and isinstance(g_len, Tensor)
            and tile_size in (1, 2, 4) and (not dropout or 0.0 <= dropout_prob < 1.0)):
        return None
    fs, gs, ls = f.shape, g.shape, f_len.shape
    if not (len(fs) == 3 and len(gs) == 3 and len(ls) == 1 and gs[0] == ls[0] == fs[0] > 0 and gs[2] == fs[2]
            and g_len.shape == ls):
        return None
    dtype, fdt, gdt = f.dtype, f_len.dtype, g_len.dtype
    if not (dtype in _FLOATS and g.dtype is dtype and fdt in _INTS and gdt in _INTS
            and f_len.get_device() == g_len.get_device() and _same_device(g, f) and _same_device(f_len, f)):
        return None
    f32 = (f_len if fdt is torch.int32 else f_len.to(torch.int32)).contiguous()
    g32 = (g_len if gdt is torch.int32 else g_len.to(torch.int32)).contiguous()
    B, T, H = fs
    seed = int(torch.randint(0, 2**31 - 1, (1,)).item()) if dropout else 0
    h, mask = _kernels().forward_dense(f.contiguous(), g.contiguous(), f32, g32, B, T, gs[1], H, relu, dropout,
                                       dropout_prob if dropout else 0.0, tile_size, seed)
    return h, mask, (f32, g32, None, (B, T, gs[1], H))


def joint_backward(dh: Tensor, mask: Tensor | None, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None,
                   max_f_len: int, max_g_len: int, pack_output: bool, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """``(grad_f, grad_g)`` from the gradient of the (dense or packed) joint output."""
    if _backend.select(dh) == "triton":
        check_devices(dh, ("mask", mask), what="grad", **_TRITON_DEVICES)
        check_devices(dh, ("f_len", f_len), ("g_len", g_len), what="f", **_TRITON_DEVICES)
        kernels = _kernels()
        boff = batch_offset.to(dh.device, torch.int64).contiguous() if pack_output else None
        return kernels.backward(dh.contiguous(), mask.contiguous() if mask is not None else None,
                                _int32(f_len), _int32(g_len), boff,
                                int(max_f_len), int(max_g_len), pack_output, float(scale))
    return _backward_torch(dh, mask, f_len, g_len, int(max_f_len), int(max_g_len), pack_output, float(scale))


_NO_GRADS = (None,) * 10  # the gradients of the Function's non-tensor and length arguments


class TransducerJointFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, f, g, f_len, g_len, pack_output, relu, dropout, batch_offset, packed_batch, tile_size,
                dropout_prob, mask_probe):
        h, mask, lengths = joint_forward_saved(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu,
                                               dropout, dropout_prob, tile_size)
        if mask is not None and mask_probe is not None:
            mask_probe.append(mask)
        # The Triton path saves the lengths (and offsets) as its kernels read them, so that its backward (same
        # path: the backend is chosen once) launches without converting them again.
        sizes = None
        if lengths is not None:
            f_len, g_len, batch_offset, sizes = lengths
        # One context attribute (each costs a dictionary entry, set and read): the Triton path's dense sizes
        # (B, T, U, H), or which path and (T, U).
        ctx.args = (sizes if sizes is not None else (lengths is not None, f.shape[1], g.shape[1]), pack_output,
                    1.0 / (1.0 - dropout_prob) if dropout else 1.0)
        ctx.save_for_backward(mask, f_len, g_len, batch_offset)
        if mask is not None:
            ctx.mark_non_differentiable(mask)
        return h

    @staticmethod
    def backward(ctx, dh):
        mask, f_len, g_len, batch_offset = ctx.saved_tensors
        sizes, pack_output, scale = ctx.args
        # The mask as the forward's kernel wrote it (contiguous), unless a saved-tensor hook gave it back in
        # another layout: the kernels read it contiguous (the PyTorch path reads any layout).
        if mask is not None and not mask.is_contiguous():
            mask = mask.contiguous()
        if len(sizes) == 4:
            df, dg = _kernels().backward_dense(dh.contiguous(), mask, f_len, g_len, *sizes, scale)
        elif sizes[0]:
            df, dg = _kernels().backward(dh.contiguous(), mask, f_len, g_len, batch_offset, *sizes[1:], pack_output,
                                         scale)
        else:
            df, dg = joint_backward(dh, mask, f_len, g_len, batch_offset, *sizes[1:], pack_output, scale)
        return (df, dg, *_NO_GRADS)


def transducer_joint(f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None = None,
                     packed_batch: int = 0, pack_output: bool = False, relu: bool = False, dropout: bool = False,
                     dropout_prob: float = 0.0, tile_size: int = 4, mask_probe: list | None = None) -> Tensor:
    """The joint with autograd; see the module docstring."""
    if not pack_output:
        h = _lean(f, g, f_len, g_len, relu, dropout, dropout_prob, tile_size, mask_probe)
        if h is not None:
            return h
    return traced_apply(f, g, f_len, g_len, pack_output, relu, dropout, batch_offset, packed_batch, tile_size,
                        dropout_prob, mask_probe)


_traced = lazy_module("apex.ops._transducer_traced")


def traced_apply(*args) -> Tensor:
    """:class:`TransducerJointFunc`'s ``apply``, or its custom ops while ``torch.compile`` or ``torch.export``
    traces (the Function's Python cannot be traced in one graph: see :mod:`apex.ops._transducer_traced`)."""
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return _traced().joint(*args)
    return TransducerJointFunc.apply(*args)


# ------------------------------------------------------------------ compat: transducer_joint_cuda.*
def forward(f, g, fLen, gLen, batchOffset, packedBatch, opt, packOutput, relu, dropout, dropoutProb,
            tileSize):  # noqa: N803 - Apex's argument names
    """``transducer_joint_cuda.forward``: ``[h]``, or ``[h, mask]`` when ReLU or dropout is on."""
    if opt not in (0, 1):
        raise RuntimeValueError(f"opt must be 0 or 1, got {opt}")
    h, mask = joint_forward(f, g, fLen, gLen, batchOffset, int(packedBatch), bool(packOutput), bool(relu),
                            bool(dropout), float(dropoutProb), int(tileSize) if opt == 1 else 1)
    return [h] if mask is None else [h, mask]


def backward(inputs, fLen, gLen, batchOffset, maxFLen, maxGLen, packOutput, scale):  # noqa: N803
    """``transducer_joint_cuda.backward``: ``inputs`` is ``[grad]`` or ``[grad, mask]``."""
    mask = inputs[1] if len(inputs) == 2 else None
    df, dg = joint_backward(inputs[0], mask, fLen, gLen, batchOffset, maxFLen, maxGLen, bool(packOutput),
                            float(scale))
    return [df, dg]
