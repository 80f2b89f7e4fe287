"""The ``torchsched`` compile backend: Inductor with Apex's convolution-backward decompositions and
optional pre-grad passes.

Apex's backend also re-scheduled Inductor's generated code onto several CUDA streams (operators off the
critical path on side streams, synchronised with events). **That multi-stream scheduler is not ported**:
on every device (CPU, and CUDA too) the backend falls back to Inductor's default single-stream
scheduling, so results equal ``backend="inductor"`` up to the decompositions below. Because nothing runs
concurrently, Inductor's buffer reuse and in-place buffers stay enabled (Apex turned them off only to
make its concurrent streams safe).

Schemes (how ``aten.convolution_backward`` with a bias gradient is split, CUDA tensors only; CPU keeps
the fused operator): ``"dwb"`` computes the input gradient first, then the weight gradient, then the bias
gradient (a sum of ``grad_output``); ``"wbd"`` computes weight and bias gradients first.
"""

from __future__ import annotations

from collections.abc import Callable
from copy import copy

import torch
from torch._dynamo import lookup_backend

from apex.contrib.torchsched import config

aten = torch.ops.aten

__all__ = ["get_backend"]

_SCHEMES = ("dwb", "wbd")


def _conv_backward_split(order: str, devices: tuple[str, ...] = ("cuda",)):
    """A decomposition of ``aten.convolution_backward`` computing its gradients separately in ``order``,
    for tensors on ``devices`` (elsewhere it declines and the fused operator stays)."""

    def decomp(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
               groups, output_mask):
        if not output_mask[2] or grad_output.device.type not in devices:
            return NotImplemented
        common = (bias_sizes, stride, padding, dilation, transposed, output_padding, groups)

        def grad_input():
            return aten.convolution_backward(grad_output, input, weight, *common, [output_mask[0], False, False])[0]

        def grad_weight():
            return aten.convolution_backward(grad_output, input, weight, *common, [False, output_mask[1], False])[1]

        def grad_bias():
            return aten.sum(grad_output, [0] + list(range(2, grad_output.dim())))

        if order == "dwb":
            gi = grad_input()
            gw = grad_weight()
            gb = grad_bias()
        else:
            gw = grad_weight()
            gb = grad_bias()
            gi = grad_input()
        return gi, gw, gb

    decomp.__name__ = f"convolution_backward_decomp_{order}"
    return decomp


convolution_backward_decomp_dwb = _conv_backward_split("dwb")
convolution_backward_decomp_wbd = _conv_backward_split("wbd")


class DecompositionsWrapper:
    """A ``torch.compile`` backend: Inductor's ``compile_fx`` with extra ``decompositions`` and config
    ``options`` (Inductor config patches), plus the pre-grad pass when ``config.enable_pre_grad_pass``."""

    def __init__(self, mode: str = "default", options: dict | None = None, dynamic: bool = False,
                 decompositions: dict | None = None) -> None:
        if mode != "default":
            raise ValueError(f"mode must be 'default', got {mode!r}")
        self.mode = mode
        self.options = dict(options or {})
        self.dynamic = dynamic
        self.decompositions = dict(decompositions or {})

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DecompositionsWrapper) and self.options == other.options
                and self.decompositions == other.decompositions and self.dynamic == other.dynamic)

    __hash__ = None

    def __call__(self, model_: torch.fx.GraphModule, inputs_: list, *args, **kwargs) -> Callable:
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.decomposition import select_decomp_table

        from apex.contrib.torchsched.passes import pre_grad_custom_pass

        decompositions = copy(select_decomp_table())
        decompositions.update(self.decompositions)
        patches = dict(self.options)
        if config.enable_pre_grad_pass:
            patches["pre_grad_custom_pass"] = pre_grad_custom_pass
        return compile_fx(model_, inputs_, config_patches=patches, decompositions=decompositions)


def get_backend(backend: str = "torch", scheme: str = "dwb") -> Callable | DecompositionsWrapper:
    """The compile backend: ``"torch"`` is PyTorch's Inductor, ``"torchsched"`` Inductor with the
    convolution-backward ``scheme`` (``"dwb"`` or ``"wbd"``, see the module docstring)."""
    if backend not in ("torch", "torchsched"):
        raise ValueError(f"Unknown compilation backend={backend!r}; use 'torch' or 'torchsched'")
    if scheme not in _SCHEMES:
        raise ValueError(f"Invalid scheme={scheme!r}, use scheme=dwb or wbd instead")
    if backend == "torch":
        return lookup_backend("inductor")
    decomp = convolution_backward_decomp_dwb if scheme == "dwb" else convolution_backward_decomp_wbd
    return DecompositionsWrapper(decompositions={aten.convolution_backward.default: decomp})
