"""``TransducerJoint`` and ``TransducerLoss`` with Apex's constructor and forward signatures."""

from __future__ import annotations

import torch

from apex._errors import RuntimeValueError
from apex.ops import transducer_joint as _joint
from apex.ops import transducer_loss as _loss
from apex.ops.transducer_joint import TransducerJointFunc, joint_forward_saved
from apex.ops.transducer_joint import _lean as _joint_lean
from apex.ops.transducer_loss import TransducerLossFunc, loss_and_saved
from apex.ops.transducer_loss import _lean as _loss_lean

# autograd.Function.apply's Python wrapper unwraps torch.func's dead wrappers (~4 µs a call): outside
# torch.func transforms and tracing (tested inline in the forwards: a function call costs ~0.5 µs) the modules
# take the C++ apply it ends in.
_joint_apply = super(torch.autograd.Function, TransducerJointFunc).apply
_loss_apply = super(torch.autograd.Function, TransducerLossFunc).apply


class TransducerJoint(torch.nn.Module):
    """RNN-T joint ``h = f[:, :, None] + g[:, None]`` with optional packing, ReLU and dropout.

    ``opt`` and ``fwd_tile_size`` select Apex's CUDA algorithm; here ``fwd_tile_size`` (1, 2 or 4) is the
    number of u values each Triton program handles and ``opt`` is accepted for compatibility. With
    ``probe_mask=True`` the ReLU/dropout masks are appended to ``self.mask_probe``.
    """

    def __init__(self, pack_output=False, relu=False, dropout=False, opt=1, fwd_tile_size=4, dropout_prob=0,
                 probe_mask=False):
        super().__init__()
        # Apex's kernel refused these with a RuntimeError at the first forward; they are checked here.
        if opt not in (0, 1):
            raise RuntimeValueError(f"opt must be 0 or 1, got {opt}")
        if fwd_tile_size not in (1, 2, 4):
            raise RuntimeValueError(f"fwd_tile_size must be 1, 2 or 4, got {fwd_tile_size}")
        masked = relu or dropout
        if masked and opt != 1:
            raise NotImplementedError("ReLU and dropout fusion is only supported with opt=1")
        self.pack_output = pack_output
        self.relu = relu
        self.dropout = dropout
        self.dropout_prob = dropout_prob
        self.opt = opt
        self.fwd_tile_size = fwd_tile_size
        self.dummy_batch_offset = torch.empty(0)
        self.mask_probe = [] if masked and probe_mask else None

    def forward(self, f, g, f_len, g_len, batch_offset=None, packed_batch=0):
        """``f`` (B, T, H), ``g`` (B, U, H), ``f_len``/``g_len`` (B,): the (B, T, U, H) or packed (rows, H) sum."""
        if self.pack_output:
            if batch_offset is None or int(packed_batch) == 0:
                raise ValueError("Please specify batch_offset and packed_batch when packing is enabled")
        else:
            # The planned eager Triton path of a dense output first (apex.ops._transducer_direct): None where
            # the general path below takes the call.
            h = _joint_lean(f, g, f_len, g_len, self.relu, self.dropout and self.training, self.dropout_prob,
                            self.fwd_tile_size if self.opt == 1 else 1, self.mask_probe)
            if h is not None:
                return h
        dropout = self.dropout and self.training
        tile = self.fwd_tile_size if self.opt == 1 else 1
        plain = not (torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling())
        if plain and not (torch.is_grad_enabled() and torch._C._any_requires_grad(f, g)):
            # Nothing to record: the joint alone, without the Function's context and saved tensors.
            h, mask, _ = joint_forward_saved(f, g, f_len, g_len, batch_offset if self.pack_output else None,
                                        packed_batch, self.pack_output, self.relu, dropout, self.dropout_prob, tile)
            if mask is not None and self.mask_probe is not None:
                self.mask_probe.append(mask)
            return h
        apply = _joint_apply if plain else _joint.traced_apply
        return apply(f, g, f_len, g_len, self.pack_output, self.relu, dropout,
                     batch_offset if self.pack_output else None, packed_batch, tile, self.dropout_prob,
                     self.mask_probe)


class TransducerLoss(torch.nn.Module):
    """RNN-T loss per sequence, (B,) in ``x``'s dtype, from logits ``x`` (the log-softmax is inside).

    ``fuse_softmax_backward=True`` computes the logits' gradient in one pass; ``False`` goes through the
    log-probabilities' gradient and PyTorch's log-softmax backward. ``opt`` is accepted for compatibility.
    """

    def __init__(self, fuse_softmax_backward=True, opt=1, packed_input=False):
        super().__init__()
        self.fuse_softmax_backward = fuse_softmax_backward
        self.opt = opt
        self.packed_input = packed_input
        self.dummy_batch_offset = torch.empty(0)

    def forward(self, x, label, f_len, y_len, blank_idx, batch_offset=None, max_f_len=None, debug_list=None):
        """``x`` (B, T, U, V) or packed (rows, V); ``debug_list=[]`` receives alpha and beta."""
        if self.packed_input:
            if batch_offset is None or max_f_len is None:
                raise ValueError("Please specify batch_offset and max_f_len when packing is enabled")
            offset, t_max = batch_offset, int(max_f_len)
        else:  # (a dense input's lattice size is x's: max_f_len is not read)
            # The planned eager Triton path first (apex.ops._transducer_direct): None where the general path
            # below takes the call.
            loss = _loss_lean(x, label, f_len, y_len, blank_idx, self.fuse_softmax_backward, debug_list, self.opt)
            if loss is not None:
                return loss
            offset = t_max = None
        if torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling():
            return _loss.traced_apply(x, label, f_len, y_len, offset, t_max, blank_idx,
                                            self.fuse_softmax_backward, debug_list, self.opt, self.packed_input)
        if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad):
            # Nothing to record: the loss alone, without the Function's context and saved tensors.
            return loss_and_saved(x, label, f_len, y_len, offset, t_max, blank_idx, debug_list, self.opt,
                                  self.packed_input)[0]
        return _loss_apply(x, label, f_len, y_len, offset, t_max, blank_idx, self.fuse_softmax_backward,
                           debug_list, self.opt, self.packed_input)
