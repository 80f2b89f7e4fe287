"""Bias + SwiGLU forward and backward: CPU time against Megatron-LM's unfused PyTorch functions
(``bias_swiglu`` / ``bias_swiglu_back``); Triton bytes and launches.

Counted under the interpreter at 64 × 2·256 fp32. Minimum bytes: forward reads x and bias and writes y;
backward reads dy, x and bias and writes dx and dbias, in one launch (Megatron's autograd sums dx for
dbias: the eager figures include that sum).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._harness import Case, Counted

TIMED = (2048, 2 * 2048)
COUNTED = (64, 2 * 256)


def _megatron_fwd(y, bias):
    y = y + bias
    y1, y2 = torch.chunk(y, 2, -1)
    return F.silu(y1) * y2


def _megatron_bwd(g, y, bias):
    y = y + bias
    y1, y2 = torch.chunk(y, 2, -1)
    return torch.cat((g * torch.sigmoid(y1) * (1 + y1 * (1 - torch.sigmoid(y1))) * y2, g * F.silu(y1)), -1)


def _with_db(dx):
    return dx, dx.sum(0)


def _inputs(m, n2):
    g = torch.Generator().manual_seed(0)
    return torch.randn(m, n2, generator=g), torch.randn(n2, generator=g), torch.randn(m, n2 // 2, generator=g)


def _timed(shape, backward):
    from apex.ops.bias_swiglu import bias_swiglu_backward_with_bias_grad, bias_swiglu_forward

    x, b, dy = _inputs(*shape)
    if backward:
        return (lambda: bias_swiglu_backward_with_bias_grad(dy, x, b)), (lambda: _with_db(_megatron_bwd(dy, x, b)))
    return (lambda: bias_swiglu_forward(x, b)), (lambda: _megatron_fwd(x, b))


def _counted(shape, backward):
    from apex.ops.bias_swiglu import bias_swiglu_backward, bias_swiglu_backward_with_bias_grad, bias_swiglu_forward

    x, b, dy = _inputs(*shape)
    if backward == "dx":  # fused_bias_swiglu.backward: no bias gradient
        return Counted(triton=lambda: bias_swiglu_backward(dy, x, b), eager=None,
                       bytes_min=2 * x.nbytes + b.nbytes + dy.nbytes, note="dx only")
    if backward:
        return Counted(triton=lambda: bias_swiglu_backward_with_bias_grad(dy, x, b),
                       eager=lambda: _with_db(_megatron_bwd(dy, x, b)),
                       bytes_min=2 * x.nbytes + 2 * b.nbytes + dy.nbytes,
                       note="eager = Megatron's bias_swiglu_back + autograd's bias sum")
    return Counted(triton=lambda: bias_swiglu_forward(x, b), eager=lambda: _megatron_fwd(x, b),
                   bytes_min=x.nbytes + b.nbytes + dy.nbytes, note="eager = Megatron's bias_swiglu")


def cases() -> list[Case]:
    name = "x".join(map(str, TIMED))
    return [Case(f"bias_swiglu_{'bwd' if bwd else 'fwd'}_{name}", timed=lambda bwd=bwd: _timed(TIMED, bwd),
                 counted=lambda bwd=bwd: _counted(COUNTED, bwd),
                 torch_label="Megatron bias_swiglu" + ("_back" if bwd else ""))
            for bwd in (False, True)] + [
        Case(f"bias_swiglu_bwd_dx_only_{'x'.join(map(str, COUNTED))}", counted=lambda: _counted(COUNTED, "dx"))]


# ----------------------------------------------------------------------------- GPU-sized cases (--device cuda)
GPU_SHAPES = [(16384, 16384)]  # input rows x 2·hidden


def _gpu_inputs(shape, dtype, device):
    from benchmarks._gpu import generator, randn

    m, n2 = shape
    g = generator(device)
    return {"x": randn((m, n2), dtype, device, g), "b": randn((n2,), dtype, device, g, 0.1),
            "dy": randn((m, n2 // 2), dtype, device, g)}


def gpu_bytes(shape, dtype, mode) -> int:
    """fwd: read x and bias, write y (half x's width). bwd: read dy, x and bias, write dx and dbias."""
    m, n2 = shape
    s = dtype.itemsize
    if mode == "fwd":
        return m * n2 * s + n2 * s + m * (n2 // 2) * s
    return m * (n2 // 2) * s + 2 * m * n2 * s + 2 * n2 * s


def gpu_cases(shapes=GPU_SHAPES, dtypes=None) -> list:
    from benchmarks._gpu import DTYPES, op_cases

    def apex_swiglu(i):
        from apex.ops.bias_swiglu import bias_swiglu

        return bias_swiglu(i["x"], i["b"])

    # Liger's SwiGLU (LigerSiLUMulFunction) takes no bias: not the same operation, so not compared.
    return op_cases("bias_swiglu", shapes, dtypes or DTYPES, ("fwd", "bwd"), _gpu_inputs,
                    {"apex": apex_swiglu, "torch": lambda i: _megatron_fwd(i["x"], i["b"])}, gpu_bytes, ("x", "b"),
                    note="torch: Megatron's unfused bias_swiglu, differentiated by autograd")
