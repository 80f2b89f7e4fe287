"""OpenFold's multi-head attention entry points (upstream ``apex.contrib.openfold_triton.mha``).

* ``AttnTri(q, k, v, mask=None, bias=None, inf=1e9, is_training=True)``: ``softmax(q·kᵀ/√d +
  (mask − 1)·inf + bias)·v`` for ``q`` ``[1, B, H, N, D]`` or ``[B, H, N, D]`` (any leading dims here), with
  gradients for ``q``, ``k``, ``v`` and ``bias``. Flash-attention Triton kernels on GPUs, PyTorch's
  ``baddbmm`` + softmax + ``bmm`` on CPUs (``apex.ops.openfold_attention``). ``is_training=False`` runs
  without recording a backward (upstream saves nothing then either).
* ``AttnBiasJIT(query, key, value, mask, bias, inf)`` / ``AttnNoBiasJIT(query, key, value, mask, inf)``:
  upstream's ``torch.compile``-d eager attention; here the same operation as ``AttnTri`` (no compilation
  at import, no first-call compile pause).
* ``CanSchTriMHA(in_shape, has_bias=True, inf=1e9, training=True)``: whether ``AttnTri`` takes a call of
  this query shape. Upstream answers from a list of tuned OpenFold shapes; apex's kernels take any shape,
  so this is True for 4-D and 5-D query shapes (5-D with a leading 1, as upstream) with a positive finite
  ``inf`` and a head dim of at most 256.
* ``enable()`` / ``disable()`` / ``is_enabled()``: the switch OpenFold reads before routing to ``AttnTri``
  (off by default, as upstream); held by one :class:`MHASwitch` object.
"""

from __future__ import annotations

import math

import torch

from apex.ops import openfold_attention as _ops
from apex.ops.openfold_attention import attention


class MHASwitch:
    """The on/off state of OpenFold's Triton attention routing."""

    def __init__(self, enabled: bool = False):
        self.enabled = bool(enabled)

    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False


SWITCH = MHASwitch()


def is_enabled() -> bool:
    """Whether OpenFold should route its attention through ``AttnTri`` (the switch in ``SWITCH``)."""
    return SWITCH.enabled


def enable() -> None:
    """Turn the fused attention on for OpenFold's callers."""
    SWITCH.enable()


def disable() -> None:
    """Turn the fused attention off for OpenFold's callers."""
    SWITCH.disable()


def CanSchTriMHA(in_shape, has_bias: bool = True, inf: float = 1e9, training: bool = True) -> bool:  # noqa: N802
    """True when ``AttnTri`` takes a call whose query has shape ``in_shape``: 4-D, or 5-D with a leading 1,
    a head dim of at most 256 and a positive finite ``inf`` (upstream answered from its tuned shapes)."""
    shape = list(in_shape)
    if len(shape) not in (4, 5) or (len(shape) == 5 and shape[0] != 1):
        return False
    if not isinstance(inf, (int, float)) or not (0 < inf < math.inf):
        return False
    return 0 < shape[-1] <= 256


def AttnTri(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,  # noqa: N802
            bias: torch.Tensor | None = None, inf: float = 1000000000.0, is_training: bool = True) -> torch.Tensor:
    """``softmax(q·kᵀ/√d + (mask − 1)·inf + bias)·v`` (OpenFold's triangle/MSA attention); without a graph
    when ``is_training`` is False. Softmax statistics in fp32, output in ``q``'s dtype."""
    if not is_training:
        with torch.no_grad():
            return attention(q, k, v, mask, bias, inf)
    # attention's planned eager path first, then its general path (a frame less than attention() itself)
    out = _ops._lean(q, k, v, mask, bias, inf)
    return out if out is not None else _ops.general(q, k, v, mask, bias, inf)


def AttnBiasJIT(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,  # noqa: N802
                bias: torch.Tensor | None, inf: float) -> torch.Tensor:
    """``AttnTri`` with a bias (upstream's compiled eager formula; here the same fused operation)."""
    return attention(query, key, value, mask, bias, inf)


def AttnNoBiasJIT(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,  # noqa: N802
                  inf: float) -> torch.Tensor:
    """``AttnTri`` without a bias (upstream's compiled eager formula; here the same fused operation)."""
    return attention(query, key, value, mask, None, inf)
