"""Bias + GELU (tanh) forward and backward: CPU time against Megatron-LM's unfused PyTorch formulas
(``bias_gelu`` / ``bias_gelu_back``); Triton bytes and launches.

Counted under the interpreter at 64 × 512 fp32. Minimum bytes: forward reads x and bias and writes y;
backward reads dy, x and bias and writes dx and dbias (Megatron's autograd sums dx for dbias: the
eager figures include that sum).
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted

TIMED = (2048, 4096)
COUNTED = (64, 512)


def _megatron_fwd(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def _megatron_bwd(g, bias, y):
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh_out)
    return ff * g


def _with_db(dx):
    return dx, dx.sum(0)


def _inputs(m, n):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, n, generator=g), torch.randn(n, generator=g), torch.randn(m, n, generator=g)


def _timed(shape, backward):
    from apex.ops.bias_gelu import bias_gelu_backward_with_bias_grad, bias_gelu_forward

    x, b, dy = _inputs(*shape)
    if backward:
        return (lambda: bias_gelu_backward_with_bias_grad(dy, x, b)), (lambda: _with_db(_megatron_bwd(dy, b, x)))
    return (lambda: bias_gelu_forward(x, b)), (lambda: _megatron_fwd(b, x))


def _counted(shape, backward):
    from apex.ops.bias_gelu import bias_gelu_backward, bias_gelu_backward_with_bias_grad, bias_gelu_forward

    x, b, dy = _inputs(*shape)
    if backward == "dx":  # fused_bias_gelu.backward: no bias gradient
        return Counted(triton=lambda: bias_gelu_backward(dy, x, b), eager=None, bytes_min=3 * x.nbytes + b.nbytes,
                       note="dx only")
    if backward:
        return Counted(triton=lambda: bias_gelu_backward_with_bias_grad(dy, x, b),
                       eager=lambda: _with_db(_megatron_bwd(dy, b, x)),
                       bytes_min=3 * x.nbytes + 2 * b.nbytes,
                       note="eager = Megatron's bias_gelu_back + autograd's bias sum")
    return Counted(triton=lambda: bias_gelu_forward(x, b), eager=lambda: _megatron_fwd(b, x),
                   bytes_min=2 * x.nbytes + b.nbytes, note="eager = Megatron's bias_gelu")


def cases() -> list[Case]:
    name = "x".join(map(str, TIMED))
    return [Case(f"bias_gelu_{'bwd' if bwd else 'fwd'}_{name}", timed=lambda bwd=bwd: _timed(TIMED, bwd),
                 counted=lambda bwd=bwd: _counted(COUNTED, bwd),
                 torch_label="Megatron bias_gelu" + ("_back" if bwd else ""))
            for bwd in (False, True)] + [
        Case(f"bias_gelu_bwd_dx_only_{'x'.join(map(str, COUNTED))}", counted=lambda: _counted(COUNTED, "dx"))]
