"""Apex's FMHA: attention over variable-length sequences packed into one ``(total, 3, heads, head_dim)``
QKV tensor, described by ``cu_seqlens`` (b + 1 cumulative lengths, int32) and ``max_s``.

``FMHAFun.apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors)`` returns the context
``(total, heads, head_dim)``: each sequence attends only to itself (a block-diagonal mask), softmax scale
``1/sqrt(head_dim)``. Here the packed rows are scattered into a padded ``(b, heads, max_s, head_dim)`` batch and
run through ``F.scaled_dot_product_attention`` with a key-padding mask (flash / memory-efficient kernels where
PyTorch has them), then gathered back; autograd gives the backward. Dtype policy: the input dtype (fp16 in
Apex; any floating dtype here), accumulation as in PyTorch's SDPA.

The ``fmhalib`` compatibility functions (``fwd``, ``bwd``, ``bwd_nl``) materialise the softmax as Apex does:
``S_dmask`` (b, heads, max_s, max_s) holds the probabilities, negated where dropout dropped them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from apex._errors import RuntimeValueError

Tensor = torch.Tensor


def _layout(qkv: Tensor, cu_seqlens: Tensor, max_s: int):
    # Apex's fmhalib checked both ranks, the 3 and a batch of at least one (TORCH_CHECK): these errors are also
    # its RuntimeError. It did not read cu_seqlens' values; they are checked here.
    if not isinstance(qkv, Tensor) or qkv.dim() != 4 or qkv.shape[1] != 3:
        raise RuntimeValueError(f"qkv must be (total, 3, heads, head_dim), got "
                                f"{tuple(qkv.shape) if isinstance(qkv, Tensor) else type(qkv).__name__}")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise RuntimeValueError("cu_seqlens must be a 1-D tensor of b + 1 cumulative sequence lengths")
    cu = cu_seqlens.to(qkv.device, torch.long)
    lens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(lens.min()) < 1 or int(cu[-1]) != qkv.shape[0]:
        raise ValueError(f"cu_seqlens must start at 0, increase strictly and end at total = {qkv.shape[0]}")
    s = int(lens.max())
    if int(max_s) < s:
        raise ValueError(f"max_s ({max_s}) is smaller than the longest sequence ({s})")
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=qkv.device), lens)
    pos = torch.arange(qkv.shape[0], device=qkv.device) - cu[seq]
    keys = torch.arange(s, device=qkv.device).view(1, s) < lens.view(-1, 1)  # (b, s) valid keys
    return seq, pos, keys, s


def _padded(qkv, seq, pos, b, s):
    """(total, 3, h, d) → q, k, v of (b, h, s, d)."""
    pad = qkv.new_zeros((b, s) + tuple(qkv.shape[1:]))
    pad = pad.index_put((seq, pos), qkv)
    return pad.permute(2, 0, 3, 1, 4).unbind(0)


def fmha(qkv: Tensor, cu_seqlens: Tensor, p_dropout: float, max_s: int, is_training: bool = True) -> Tensor:
    """Context ``(total, heads, head_dim)`` of the packed sequences (autograd through SDPA)."""
    if not p_dropout < 1:  # Apex's fmha_api: TORCH_CHECK(p_dropout < 1.f)
        raise RuntimeValueError(f"p_dropout must be < 1, got {p_dropout!r}")
    seq, pos, keys, s = _layout(qkv, cu_seqlens, max_s)
    b = keys.shape[0]
    q, k, v = _padded(qkv, seq, pos, b, s)
    ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=keys.view(b, 1, 1, s),
                                         dropout_p=float(p_dropout) if is_training else 0.0)
    return ctx.permute(0, 2, 1, 3)[seq, pos]


class FMHAFun:
    """Apex's ``FMHAFun``: ``FMHAFun.apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors)``."""

    @staticmethod
    def apply(qkv, cu_seqlens, p_dropout, max_s, is_training, zero_tensors=False):
        return fmha(qkv, cu_seqlens, p_dropout, max_s, is_training)


class FMHA(torch.nn.Module):
    """Apex's ``FMHA(config)`` module: ``config`` has ``attention_probs_dropout_prob``, ``num_attention_heads``
    and ``hidden_size``; ``forward(qkv, cu_seqlens, max_s, is_training=True, zero_tensors=False)`` takes the
    packed ``(total, 3·hidden)`` QKV and returns ``(total, hidden)``."""

    def __init__(self, config):
        super().__init__()
        self.p_dropout = config.attention_probs_dropout_prob
        self.h = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.d = self.hidden_size // self.h
        if self.d * self.h != self.hidden_size:
            raise ValueError("hidden_size must be divisible by num_attention_heads")

    def forward(self, qkv, cu_seqlens, max_s, is_training=True, zero_tensors=False):
        ctx = FMHAFun.apply(qkv.view(-1, 3, self.h, self.d), cu_seqlens, self.p_dropout, max_s, is_training,
                            zero_tensors)
        return ctx.reshape(-1, self.hidden_size)


# --------------------------------------------------------------------------------- compat: fmhalib.*
def fwd(qkv, cu_seqlens, p_dropout, max_s, is_training, is_nl, zero_tensors, generator):
    """``[context (total, h, d), S_dmask (b, h, max_s, max_s)]``."""
    seq, pos, keys, s = _layout(qkv, cu_seqlens, max_s)
    b, ms = keys.shape[0], int(max_s)
    with torch.no_grad():
        q, k, v = _padded(qkv, seq, pos, b, s)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
        probs = torch.softmax(scores.masked_fill(~keys.view(b, 1, 1, s), float("-inf")), -1)
        p = float(p_dropout) if is_training else 0.0
        keep = (torch.rand(probs.shape, generator=generator, device=probs.device) >= p) if p > 0 else None
        dropped = probs if keep is None else probs * keep / (1.0 - p)
        ctx = torch.matmul(dropped, v.float()).to(qkv.dtype)
        smask = probs if keep is None else torch.where(keep, probs, -probs)
        smask = F.pad(smask, (0, ms - s, 0, ms - s)).to(qkv.dtype)
    return [ctx.permute(0, 2, 1, 3)[seq, pos], smask]


def bwd(dout, qkv, S_dmask, cu_seqlens, p_dropout, max_s, zero_tensors):  # noqa: N803
    """``[dqkv (total, 3, h, d), dP]`` from the saved ``S_dmask``."""
    seq, pos, keys, s = _layout(qkv, cu_seqlens, max_s)
    b = keys.shape[0]
    dout = dout.reshape(qkv.shape[0], qkv.shape[2], qkv.shape[3])  # any layout of (total, h, d), as Apex
    with torch.no_grad():
        q, k, v = (t.float() for t in _padded(qkv, seq, pos, b, s))
        sm = S_dmask[..., :s, :s].float()
        probs, keep = sm.abs(), sm >= 0
        p = float(p_dropout)
        scale = 1.0 / (1.0 - p) if p > 0 else 1.0
        do = dout.new_zeros((b, s) + tuple(dout.shape[1:])).index_put((seq, pos), dout).permute(0, 2, 1, 3).float()
        dropped = torch.where(keep, probs * scale, 0.0)
        dv = dropped.transpose(-1, -2) @ do
        dp = torch.where(keep, (do @ v.transpose(-1, -2)) * scale, 0.0)
        ds = probs * (dp - (dp * probs).sum(-1, keepdim=True))
        c = 1.0 / math.sqrt(q.shape[-1])
        dq, dk = ds @ k * c, ds.transpose(-1, -2) @ q * c
        dqkv = torch.stack([dq, dk, dv], 0).permute(1, 3, 0, 2, 4)[seq, pos].to(qkv.dtype)
    return [dqkv, dp.to(qkv.dtype)]


def bwd_nl(dout, qkv, S_dmask, cu_seqlens, p_dropout, max_s, zero_tensors):  # noqa: N803
    """The small-batch variant: ``[dqkv, dP, None]``."""
    return bwd(dout, qkv, S_dmask, cu_seqlens, p_dropout, max_s, zero_tensors) + [None]


def fwd_nl(qkv, cu_seqlens, p_dropout, max_s, is_training, is_nl, zero_tensors, generator):
    """Upstream's ``fmhalib.fwd_nl``: the same forward as ``fwd`` (the ``is_nl`` flag chose a CUDA kernel
    variant for short sequences; here both take the same path).
    """
    return fwd(qkv, cu_seqlens, p_dropout, max_s, is_training, is_nl, zero_tensors, generator)
