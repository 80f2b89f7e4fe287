"""The transducer joint and loss as ``torch.library`` custom ops, for tracers: ``torch.compile``
(``fullgraph=True`` included) and ``torch.export`` record one opaque node each way, with a fake
implementation, instead of tracing the Python around the kernels (the backend choice reads a context variable,
the PyTorch path's range checks read values back: neither can be traced). Eager calls do not come here (the
ops' own ``autograd.Function`` is cheaper); the op bodies are those eager functions, so both paths and their
checks behave as in eager mode when the compiled graph runs."""

from __future__ import annotations

import torch

from apex.ops import transducer_joint as _tj
from apex.ops import transducer_loss as _tl

Tensor = torch.Tensor


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------- loss
@torch.library.custom_op("apex::transducer_loss_fwd", mutates_args=())
def _loss_fwd(x: Tensor, label: Tensor, f_len: Tensor, y_len: Tensor, batch_offset: Tensor | None,
              max_f_len: int | None, blank_idx: int, fused: bool, opt: int, packed_input: bool
              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # (fused picks the backward's formula: an argument so that the autograd context sees it)
    loss, lse, alpha, beta, _ = _tl.loss_and_saved(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx,
                                                   None, opt, packed_input)
    return loss, lse, alpha, beta


@_loss_fwd.register_fake
def _(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, fused, opt, packed_input):
    B = f_len.shape[0]
    if packed_input:  # the lattice's U is max(y_len) + 1: known when the op runs
        T, U = max_f_len, torch.library.get_ctx().new_dynamic_size()
    else:
        T, U = x.shape[1], x.shape[2]
    acc = _acc(x.dtype)
    return (x.new_empty(B), x.new_empty(x.shape[:-1], dtype=acc), x.new_empty(B, T, U, dtype=acc),
            x.new_empty(B, T, U, dtype=acc))


@torch.library.custom_op("apex::transducer_loss_bwd", mutates_args=())
def _loss_bwd(x: Tensor, loss_grad: Tensor, lse: Tensor, alpha: Tensor, beta: Tensor, label: Tensor,
              f_len: Tensor, y_len: Tensor, batch_offset: Tensor | None, blank_idx: int, fused: bool,
              packed_input: bool) -> Tensor:
    return _tl.gradient(x, loss_grad, lse, alpha, beta, label, f_len, y_len, batch_offset, blank_idx, fused,
                        packed_input)


@_loss_bwd.register_fake
def _(x, loss_grad, lse, alpha, beta, label, f_len, y_len, batch_offset, blank_idx, fused, packed_input):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _loss_setup(ctx, inputs, output):
    x, label, f_len, y_len, batch_offset, _, blank_idx, fused, _, packed_input = inputs
    _, lse, alpha, beta = output
    ctx.save_for_backward(x, lse, alpha, beta, label, f_len, y_len, batch_offset)
    ctx.args = blank_idx, fused, packed_input


def _loss_backward(ctx, loss_grad, *_):
    x, lse, alpha, beta, label, f_len, y_len, batch_offset = ctx.saved_tensors
    dx = _loss_bwd(x, loss_grad, lse, alpha, beta, label, f_len, y_len, batch_offset, *ctx.args)
    return (dx,) + (None,) * 9


_loss_fwd.register_autograd(_loss_backward, setup_context=_loss_setup)


def loss(x, label, f_len, y_len, batch_offset, max_f_len, blank_idx, fuse_softmax_backward, debug_list, opt,
         packed_input) -> Tensor:
    """:class:`~apex.ops.transducer_loss.TransducerLossFunc`'s ``apply`` (same arguments) as the custom ops."""
    out = _loss_fwd(x, label, f_len, y_len, batch_offset, None if max_f_len is None else int(max_f_len),
                    blank_idx, bool(fuse_softmax_backward), opt, bool(packed_input))
    if debug_list == []:
        debug_list += out[2:4]
    return out[0]


# ------------------------------------------------------------------------------------------------ joint
@torch.library.custom_op("apex::transducer_joint_fwd", mutates_args=())
def _joint_fwd(f: Tensor, g: Tensor, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None,
               packed_batch: int, pack_output: bool, relu: bool, dropout: bool, dropout_prob: float,
               tile_size: int) -> tuple[Tensor, Tensor]:
    h, mask, _ = _tj.joint_forward_saved(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu,
                                         dropout, dropout_prob, tile_size)
    return h, (mask if mask is not None else h.new_empty(0, dtype=torch.uint8))  # (no mask: an empty one)


@_joint_fwd.register_fake
def _(f, g, f_len, g_len, batch_offset, packed_batch, pack_output, relu, dropout, dropout_prob, tile_size):
    shape = (packed_batch, f.shape[2]) if pack_output else (f.shape[0], f.shape[1], g.shape[1], f.shape[2])
    return f.new_empty(shape), f.new_empty(shape if relu or dropout else (0,), dtype=torch.uint8)


@torch.library.custom_op("apex::transducer_joint_bwd", mutates_args=())
def _joint_bwd(dh: Tensor, mask: Tensor | None, f_len: Tensor, g_len: Tensor, batch_offset: Tensor | None,
               T: int, U: int, pack_output: bool, scale: float) -> tuple[Tensor, Tensor]:
    return _tj.joint_backward(dh, mask, f_len, g_len, batch_offset, T, U, pack_output, scale)


@_joint_bwd.register_fake
def _(dh, mask, f_len, g_len, batch_offset, T, U, pack_output, scale):
    B, H = f_len.shape[0], dh.shape[-1]
    return dh.new_empty(B, T, H), dh.new_empty(B, U, H)


def _joint_setup(ctx, inputs, output):
    f, g, f_len, g_len, batch_offset, _, pack_output, relu, dropout, dropout_prob, _ = inputs
    masked = relu or dropout
    ctx.save_for_backward(output[1] if masked else None, f_len, g_len, batch_offset)
    ctx.args = f.shape[1], g.shape[1], pack_output, 1.0 / (1.0 - dropout_prob) if dropout else 1.0


def _joint_backward(ctx, dh, _):
    mask, f_len, g_len, batch_offset = ctx.saved_tensors
    df, dg = _joint_bwd(dh, mask, f_len, g_len, batch_offset, *ctx.args)
    return (df, dg) + (None,) * 9


_joint_fwd.register_autograd(_joint_backward, setup_context=_joint_setup)


def joint(f, g, f_len, g_len, pack_output, relu, dropout, batch_offset, packed_batch, tile_size, dropout_prob,
          mask_probe) -> Tensor:
    """:class:`~apex.ops.transducer_joint.TransducerJointFunc`'s ``apply`` (same arguments) as the custom
    ops."""
    h, mask = _joint_fwd(f, g, f_len, g_len, batch_offset, int(packed_batch), bool(pack_output), bool(relu),
                         bool(dropout), float(dropout_prob), int(tile_size))
    if (relu or dropout) and mask_probe is not None:
        mask_probe.append(mask)
    return h
