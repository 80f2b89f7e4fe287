"""Per-channel batch-norm building blocks for ``SyncBatchNorm``: statistics, forward and backward.

Every function takes the input as a contiguous 3-D view ``[N, C, L]`` (channel-first ``[N, C, *]``
flattened to ``L``; channel-last ``[..., C]`` and 2-D ``[N, C]`` as ``[M, C, 1]``), computes in fp32 and
returns fp32 statistics; elementwise outputs have the input's dtype (fp32, fp16 or bf16). With ``xhat =
(x - mean) * invstd``, ``scale = weight * invstd`` and ``shift = bias - mean * scale``:

* forward:  ``y = x * scale + shift (+ z)``, then ``relu`` with ``fuse_relu``;
* backward: ``dy' = dy * (y > 0)`` with ``fuse_relu`` (else ``dy``); the reduction gives
  ``sum_dy = Σ dy'`` and ``sum_dy_xmu = Σ dy' (x - mean)`` per channel (``grad_bias`` and
  ``grad_weight = sum_dy_xmu * invstd`` come from these), and with the group's means ``mean_dy`` and
  ``mean_dy_xmu`` the input gradient is
  ``dx = weight * invstd * (dy' - mean_dy - (x - mean) * invstd² * mean_dy_xmu)``; ``dz = dy'``.

Statistics are one pass over the input with per-channel shifted sums (shift = the channel's first
element), which keeps fp32 accuracy when the mean is large against the spread.

On the Triton path a training step finishes its per-channel work in kernels too (:func:`train_stats`,
:func:`eval_stats`, :func:`backward_sums`, :func:`backward_elemt_sums`): statistics, running-statistics
update, scale/shift, ``grad_weight``/``grad_bias`` and the group means of the backward, instead of some
thirty per-channel PyTorch operators whose dispatch dominated the host cost of a call.
"""

from __future__ import annotations

import math

import torch

from apex import _backend
from apex._errors import RuntimeTypeError, RuntimeValueError
from apex.ops._norm import check_devices as _check_devices

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def acc_dtype(x: torch.Tensor) -> torch.dtype:
    """Computation dtype: fp32, or fp64 for fp64 inputs (which always take the PyTorch path)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _select(x: torch.Tensor) -> str:
    return "torch" if x.dtype == torch.float64 else _backend.select(x)


_KERNELS = None


def _kernels():
    """The Triton kernels' module, imported on first use (importing this module imports no Triton)."""
    global _KERNELS
    if _KERNELS is None:
        from apex._kernels import sync_batch_norm

        _KERNELS = sync_batch_norm
    return _KERNELS


def backend(x: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: the path the functions below take for ``x``."""
    return _select(x)


def as_ncl(x: torch.Tensor, channel_last: bool) -> torch.Tensor:
    """The contiguous ``[N, C, L]`` view the functions below expect."""
    if x.dim() < 2:
        raise ValueError(f"input must have at least 2 dimensions (N, C, ...), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        # Apex's syncbn kernels dispatched on the dtype: any other was their RuntimeError.
        raise RuntimeTypeError(f"input must be float32, float16, bfloat16 or float64, got {x.dtype}")
    x = x.contiguous()
    if channel_last or x.dim() == 2:
        return x.reshape(-1, x.shape[-1], 1)
    # Not -1: an empty batch (a rank without samples) would leave L ambiguous.
    return x.reshape(x.shape[0], x.shape[1], math.prod(x.shape[2:]))


def _scale_shift(x: torch.Tensor, mean, invstd, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel affine map of the normalisation, ``y = x * scale + shift``, in the accumulation
    dtype (a missing weight is one, a missing bias zero)."""
    C, acc = x.shape[1], acc_dtype(x)
    w = weight.to(acc) if weight is not None else torch.ones(C, dtype=acc, device=x.device)
    b = bias.to(acc) if bias is not None else torch.zeros(C, dtype=acc, device=x.device)
    scale = w * invstd
    return scale, b - mean * scale


def scale_shift(x: torch.Tensor, mean, invstd, weight, bias) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, shift)`` of the functions below, computed once by a caller that runs several of them."""
    return _scale_shift(x, mean, invstd, weight, bias)


def _v(t):
    """The PyTorch path works on ``[M, C]`` when ``L == 1``: PyTorch's CPU batch-norm kernels are several
    times faster on 2-D inputs than on ``[M, C, 1]``."""
    return None if t is None else (t.view(t.shape[0], t.shape[1]) if t.shape[2] == 1 else t)


def _ch(v, t):
    """A per-channel vector shaped to broadcast against ``t`` (2-D or 3-D)."""
    return v if t.dim() == 2 else v[:, None]


def check_devices(x: torch.Tensor, *named: tuple[str, torch.Tensor | None], what: str = "input") -> None:
    """The Triton kernels read these next to ``x``: one of another device would be read as a device address
    (an illegal access), so it is refused naming it, as PyTorch's operators refuse mixed devices."""
    _check_devices(x, *named, what=what, error=RuntimeValueError, optional=True)


def batch_norm_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel ``(mean, biased var)`` in fp32 of ``x`` ``[N, C, L]``."""
    if x.shape[0] * x.shape[2] == 0:
        raise ValueError("batch_norm_stats needs at least one element per channel")
    if _select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        return kernels.stats(x)
    # PyTorch's fused CPU statistics kernel (a fraction of var_mean's time over dims (0, 2)).
    acc = acc_dtype(x)
    mean, var = torch.batch_norm_update_stats(_v(x).to(acc), None, None, 0.0)
    return mean.to(acc), var.to(acc)


def batch_norm_elemt(x, mean, invstd, weight, bias, z=None, fuse_relu: bool = False,
                     scale_shift: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``y = x * scale + shift (+ z)`` (then relu with ``fuse_relu``), in ``x``'s dtype. ``scale_shift``:
    :func:`scale_shift`'s answer for these arguments, when the caller has it (saves four operators)."""
    scale, shift = scale_shift or _scale_shift(x, mean, invstd, weight, bias)
    if _select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        check_devices(x, ("scale", scale), ("shift", shift), ("z", z))
        return kernels.forward(x, scale, shift, z, fuse_relu)
    x2, z2 = _v(x), _v(z)
    if x2.dim() == 2:
        y = torch.addcmul(shift, x2.to(acc_dtype(x2)), scale)
    else:
        # PyTorch's eval-mode batch-norm kernel with zero mean, unit variance and eps=0 is
        # x * scale + shift, faster than a broadcasting addcmul over (N, C, L).
        y = torch.batch_norm(x2.to(acc_dtype(x2)), scale, shift, torch.zeros_like(mean), torch.ones_like(mean), False,
                             0.0, 0.0, False)
    if z2 is not None:
        y += z2
    if fuse_relu:
        y.relu_()
    return y.to(x.dtype).view(x.shape)


def _dy_act(dy, x, scale, shift, z, fuse_relu):
    """``dy`` (fp32) after the fused relu's mask; all arguments already through :func:`_v`."""
    dyf = dy.to(acc_dtype(x))
    if not fuse_relu:
        return dyf
    pre = torch.addcmul(_ch(shift, x), x.to(acc_dtype(x)), _ch(scale, x))
    if z is not None:
        pre += z
    return dyf * (pre > 0)


def relu_grad(dy, x, mean, invstd, weight, bias, z=None) -> torch.Tensor:
    """``dy * (y > 0)`` for the fused relu, in fp32 (PyTorch ops): lets the PyTorch path mask ``dy`` once
    for both backward passes (the Triton kernels recompute the mask on the fly instead)."""
    scale, shift = _scale_shift(x, mean, invstd, weight, bias)
    return _dy_act(_v(dy), _v(x), scale, shift, _v(z), True).view(x.shape)


def batch_norm_backward_reduce(dy, x, mean, invstd, weight, bias, z=None, fuse_relu: bool = False,
                               scale_shift: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Local per-channel ``(sum_dy, sum_dy_xmu)`` in fp32 (``dy`` after the fused relu's mask)."""
    scale, shift = scale_shift or _scale_shift(x, mean, invstd, weight, bias)
    if _select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        check_devices(x, ("dy", dy), ("mean", mean), ("scale", scale), ("shift", shift), ("z", z))
        return kernels.backward_reduce(dy, x, mean, scale, shift, z, fuse_relu)
    x, dy, z = _v(x), _v(dy), _v(z)
    d = _dy_act(dy, x, scale, shift, z, fuse_relu)
    xf = x.to(acc_dtype(x))
    ones = torch.ones_like(mean)
    # PyTorch's fused CPU kernel in eval mode with unit variance and eps=0 returns exactly
    # (Σ dy (x - mean), Σ dy) as (grad_weight, grad_bias) in one pass over dy and x.
    _, sum_dy_xmu, sum_dy = torch.ops.aten.native_batch_norm_backward(
        d, xf, ones, mean, ones, None, None, False, 0.0, [False, True, True])
    return sum_dy, sum_dy_xmu


def batch_norm_backward_elemt(dy, x, mean, invstd, weight, bias, mean_dy, mean_dy_xmu, z=None,
                              fuse_relu: bool = False, need_dz: bool = False,
                              scale_shift: tuple[torch.Tensor, torch.Tensor] | None = None):
    """``(dx, dz)`` in ``x``'s dtype (``dz`` only with ``need_dz``, else None)."""
    scale, shift = scale_shift or _scale_shift(x, mean, invstd, weight, bias)
    if _select(x) == "triton":
        from apex._kernels import sync_batch_norm as kernels

        check_devices(x, ("dy", dy), ("mean", mean), ("invstd", invstd), ("scale", scale), ("shift", shift),
                      ("mean_dy", mean_dy), ("mean_dy_xmu", mean_dy_xmu), ("z", z))
        return kernels.backward_elemt(dy, x, mean, invstd, scale, shift, mean_dy, mean_dy_xmu, z, fuse_relu,
                                      need_dz)
    shape = x.shape
    x, dy, z = _v(x), _v(dy), _v(z)
    d = _dy_act(dy, x, scale, shift, z, fuse_relu)
    k = mean_dy_xmu * invstd * invstd
    # dx = d * scale + x * A + B with per-channel A, B: one fused affine pass over x (batch norm in eval
    # mode with zero mean, unit variance, eps=0) and one addcmul.
    a = -scale * k
    b = scale * (k * mean - mean_dy)
    zeros, ones = torch.zeros_like(mean), torch.ones_like(mean)
    dx = torch.batch_norm(x.to(acc_dtype(x)), a, b, zeros, ones, False, 0.0, 0.0, False)
    dx.addcmul_(d, _ch(scale, x))
    dz = d.to(x.dtype).view(shape) if need_dz else None
    return dx.to(x.dtype).view(shape), dz


# ---------------------------------------------------------------------- Triton path: per-channel work in kernels
# These take the contiguous input as it is (any shape) with its ``(N, C, L)`` sizes from :func:`ncl_sizes`,
# and a per-channel fp32 ``st`` buffer ``[4, C]``: rows mean, invstd, scale, shift.
def ncl_sizes(x: torch.Tensor, channel_last: bool) -> tuple[int, int, int]:
    """The ``(N, C, L)`` of :func:`as_ncl`'s view of ``x`` (same checks), without making the view."""
    if x.dim() < 2:
        raise ValueError(f"input must have at least 2 dimensions (N, C, ...), got shape {tuple(x.shape)}")
    if x.dtype not in _FLOATS:
        raise RuntimeTypeError(f"input must be float32, float16, bfloat16 or float64, got {x.dtype}")
    shape = x.shape
    if channel_last or len(shape) == 2:
        C = shape[-1]
        return x.numel() // C if C else 0, C, 1
    N, C = shape[0], shape[1]
    # L from the element count (no slice and product) unless that is ambiguous (an empty dimension)
    return N, C, (x.numel() // (N * C) if N and C else math.prod(shape[2:]))


def train_stats(x: torch.Tensor, ncl: tuple[int, int, int], weight, bias, running_mean, running_var, eps: float,
                momentum: float, gather=None, num_batches_tracked=None) -> tuple[int, torch.Tensor]:
    """Triton path (``backend(x) == "triton"``, ``x`` contiguous and not empty): ``(count, st)`` of the
    batch, and ``running_mean``/``running_var`` (contiguous, or None) updated in place with ``momentum``
    (none when 0) and the unbiased variance. ``gather`` (with ranks): called with this rank's fp64 row
    ``[count, mean (C), var (C)]``, returns ``(every rank's row as [world, 1 + 2C], total count)``; the rows
    are merged in fp64. ``num_batches_tracked`` (an integer tensor, or None) is incremented by one in the kernel
    that updates the running statistics (no operator of its own)."""
    check_devices(x, ("weight", weight), ("bias", bias), ("running_mean", running_mean),
                  ("running_var", running_var), ("num_batches_tracked", num_batches_tracked))
    return _kernels().train_stats(x, ncl, weight, bias, running_mean, running_var, eps, momentum, gather,
                                  num_batches_tracked)


def eval_stats(C: int, weight, bias, running_mean, running_var, eps: float, x: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Triton path: ``st`` from the running statistics (``x``: the input they will normalise, whose device they
    must share)."""
    check_devices(running_mean if x is None else x, ("weight", weight), ("bias", bias),
                  ("running_mean", running_mean), ("running_var", running_var),
                  what="running_mean" if x is None else "input")
    return _kernels().eval_stats(C, weight, bias, running_mean, running_var, eps)


def normalize(x: torch.Tensor, ncl: tuple[int, int, int], st: torch.Tensor, z=None,
              fuse_relu: bool = False) -> torch.Tensor:
    """Triton path: :func:`batch_norm_elemt` with ``st`` (:func:`train_stats`'s or :func:`eval_stats`'s, made
    on ``x``'s device), shaped like ``x``. ``z``'s device is its caller's to check, before the statistics
    update the running ones (``SyncBatchnormFunction.forward``)."""
    return _kernels().normalize(x, ncl, st, z, fuse_relu)


def backward_sums(dy, x, ncl: tuple[int, int, int], st, z=None, fuse_relu: bool = False, grad_weight=None,
                  grad_bias=None) -> torch.Tensor:
    """Triton path: an fp32 workspace whose first ``2 * C`` values are ``[Σ dy', Σ dy' (x - mean)]`` (the
    view ``[:2]`` is what ranks all-reduce); writes ``Σ dy' (x - mean) * invstd`` into ``grad_weight`` and
    ``Σ dy'`` into ``grad_bias`` where given (any float dtype).

    The backward of :func:`normalize`'s call, with no device checks of its own: ``x``, ``st`` and ``z`` are
    what that forward took (and checked), ``dy`` is autograd's gradient of its output (the engine refuses one
    on another device), and ``grad_weight``/``grad_bias`` are allocated like the checked parameters."""
    return _kernels().backward_sums(dy, x, ncl, st, z, fuse_relu, grad_weight, grad_bias)


def backward_elemt_sums(dy, x, ncl: tuple[int, int, int], st, sums, count, z=None, fuse_relu: bool = False,
                        need_dz: bool = False):
    """Triton path: :func:`batch_norm_backward_elemt`, shaped like ``x``, with ``mean_dy, mean_dy_xmu = sums
    / count`` computed in the kernel (``sums``: :func:`backward_sums`'s workspace; ``count`` None: both zero).
    No device checks, as :func:`backward_sums`."""
    return _kernels().backward_elemt_sums(dy, x, ncl, st, sums, count, z, fuse_relu, need_dz)
