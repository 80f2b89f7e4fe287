"""``GroupNorm(num_groups, num_channels, eps=1e-5, affine=True, device=None, dtype=None, act=None)``.

Apex's module, on ``apex.ops.group_norm``: NHWC (channels_last) and NCHW inputs, fp32/fp16/bf16 with
parameters of the same or another floating dtype, ``act="silu"`` (or ``"swish"``) fused. Apex routes
unsupported shapes (channel counts outside a fixed list, groups other than 16/32, NCHW) to PyTorch; here
every shape runs the same kernels. The functional helpers keep Apex's names; the "one pass", "two pass" and
"v2" variants are one implementation (the kernels pick their split from the shape).
"""

from __future__ import annotations

import functools

import torch
from torch.nn import init
from torch.nn.parameter import Parameter

from apex._errors import AssertValueError
from apex.ops.group_norm import check_args, group_norm

Tensor = torch.Tensor

__all__ = ["GroupNorm"]


@functools.cache
def get_cc_and_sm_count(device_index: int):
    """``((major, minor), multiprocessor count)`` of a CUDA device; ``((0, 0), 0)`` without CUDA."""
    if not torch.cuda.is_available():
        return (0, 0), 0
    props = torch.cuda.get_device_properties(device_index)
    return (props.major, props.minor), props.multi_processor_count


def torch_group_norm(x: Tensor, g: int, w: Tensor | None, b: Tensor | None, eps: float, act: str | None = ""
                     ) -> Tensor:
    """Apex's PyTorch fallback: GroupNorm (+ SiLU) computed in the weight dtype, output in the input dtype."""
    xdtype = x.dtype
    if w is not None and w.dtype != xdtype:
        x = x.to(w.dtype)
    y = torch.nn.functional.group_norm(x, g, w, b, eps)
    if act in ("silu", "swish"):
        y = torch.nn.functional.silu(y)
    return y.to(xdtype)


def cuda_group_norm_nhwc_one_pass(x: Tensor, G: int, weight: Tensor, bias: Tensor, eps: float,
                                  act: str | None = None) -> Tensor:
    return group_norm(x, G, weight, bias, eps, act or "")


cuda_group_norm_nhwc_two_pass = cuda_group_norm_nhwc_one_pass
cuda_group_norm_v2_nhwc = cuda_group_norm_nhwc_one_pass


class GroupNorm(torch.nn.Module):
    """GroupNorm with optional fused SiLU/Swish; ``weight`` starts at ones and ``bias`` at zeros."""

    __constants__ = ["num_groups", "num_channels", "eps", "affine", "act"]
    SUPPORTED_DTYPES = frozenset((x, w) for x in (torch.float32, torch.float16, torch.bfloat16)
                                 for w in (torch.float32, torch.float16, torch.bfloat16))
    # Apex's GroupNorm v2 needs Blackwell-class GPUs with enough SMs; kept for code that reads it.
    GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT = {(10, 0): 148}

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None, act: str | None = None) -> None:
        super().__init__()
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups <= 0:
            raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
        if num_channels % num_groups != 0:
            raise ValueError("num_channels must be divisible by num_groups "
                             f"(num_channels={num_channels}, num_groups={num_groups})")
        act = act.lower() if act else act
        if act not in (None, "", "silu", "swish"):  # Apex asserts this in its kernels' launchers
            raise AssertValueError(f"act must be one of '', 'silu', 'swish' or None, got {act!r}")
        self.num_groups = num_groups
        self.num_channels = num_channels
        self.eps = eps
        self.affine = affine
        self.act = act
        factory = {"device": device, "dtype": dtype}
        if affine:
            self.weight = Parameter(torch.empty(num_channels, **factory))
            self.bias = Parameter(torch.empty(num_channels, **factory))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.affine:
            init.ones_(self.weight)
            init.zeros_(self.bias)

    def _check_legality(self, input: Tensor) -> bool:
        """Whether ``input`` runs on apex's kernels: any floating input of a valid shape does."""
        try:
            check_args(input, self.num_groups, self.weight, self.bias, self.act)
        except (TypeError, ValueError):
            return False
        return input.dtype in (torch.float32, torch.float16, torch.bfloat16)

    def _check_v2_legality(self, input: Tensor) -> bool:
        """Apex's v2 kernel selection; here there is a single implementation, reported as v2 where Apex would
        pick v2 (NHWC, fp16/bf16 with same-dtype parameters, a large-SM-count Blackwell GPU)."""
        if not (self.affine and input.dim() == 4 and input.is_contiguous(memory_format=torch.channels_last)):
            return False
        if input.dtype not in (torch.float16, torch.bfloat16) or self.weight.dtype != input.dtype:
            return False
        if input.device.type != "cuda":
            return False
        cc, sm = get_cc_and_sm_count(input.device.index or 0)
        return sm >= self.GN_V2_SUPPORTED_LOWER_BOUND_SM_COUNT.get(cc, 1 << 30)

    def forward(self, input: Tensor) -> Tensor:
        return group_norm(input, self.num_groups, self.weight, self.bias, self.eps, self.act or "")

    def extra_repr(self) -> str:
        s = f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
        return s + (f", act={self.act}" if self.act else "")
