"""apex.mlp.MLP and apex.fused_dense.FusedDenseGeluDense, forward + backward: CPU time against the
``nn.Sequential`` equivalent; Triton bytes and launches.

Timed at DLRM-like sizes (batch 2048, MLP 512-256-128 with ReLU) and GPT-like sizes (4096 tokens,
1024 → 4096 → 1024 with tanh-GELU). Counted under the interpreter at scaled-down shapes (batch 64,
MLP 128-64-32; 128 tokens, 64 → 256 → 64), fp32.

Minimum bytes: the GEMMs' own traffic: every GEMM reads its two operands (and bias) once and writes its
result (and the bias gradient) once. The backward also needs the activation's derivative: one read of each
saved activation it uses is added to the minimum (a GEMM cannot know act' without it); the note gives the
ratio without it too.
"""

from __future__ import annotations

import torch
from torch import nn

from benchmarks._harness import Case, Counted

DLRM = (2048, [512, 256, 128])
GPT = (4096, [1024, 4096, 1024])
DLRM_COUNTED = (64, [128, 64, 32])
GPT_COUNTED = (128, [64, 256, 64])


def _mlp(batch, sizes, grad=True):
    from apex.mlp import MLP

    torch.manual_seed(0)
    ours = MLP(sizes, activation="relu")
    layers = []
    for i in range(len(sizes) - 1):
        lin = nn.Linear(sizes[i], sizes[i + 1])
        with torch.no_grad():
            lin.weight.copy_(ours.weights[i])
            lin.bias.copy_(ours.biases[i])
        layers += [lin, nn.ReLU()]
    x = torch.randn(batch, sizes[0], requires_grad=grad)
    return ours, nn.Sequential(*layers), x


def _gelu_dense(batch, sizes, grad=True):
    from apex.fused_dense import FusedDenseGeluDense

    torch.manual_seed(0)
    ours = FusedDenseGeluDense(*sizes)
    l1, l2 = nn.Linear(sizes[0], sizes[1]), nn.Linear(sizes[1], sizes[2])
    with torch.no_grad():
        l1.weight.copy_(ours.weight1)
        l1.bias.copy_(ours.bias1)
        l2.weight.copy_(ours.weight2)
        l2.bias.copy_(ours.bias2)
    x = torch.randn(batch, sizes[0], requires_grad=grad)
    return ours, nn.Sequential(l1, nn.GELU(approximate="tanh"), l2), x


def _step(model, x, dy):
    params = [x, *model.parameters()]
    return lambda: torch.autograd.grad(model(x), params, dy)


def _timed(build, batch, sizes, dtype=torch.float32):
    ours, ref, x = build(batch, sizes)
    ours, ref = ours.to(dtype), ref.to(dtype)
    x = x.detach().to(dtype).requires_grad_()
    dy = torch.randn(batch, sizes[-1]).to(dtype)
    return _step(ours, x, dy), _step(ref, x, dy)


def _gemm_bytes(batch, sizes, backward, act_reads):
    """The GEMMs' own traffic in fp32 bytes; ``act_reads`` adds one read of the saved activations."""
    total = 0
    for i in range(len(sizes) - 1):
        a, o = sizes[i], sizes[i + 1]
        w, b = a * o, o
        if not backward:
            total += batch * a + w + b + batch * o
        else:
            total += batch * o + batch * a + w + b  # wgrad: reads g and the layer input, writes dW and db
            total += batch * o + w + batch * a      # dgrad: reads g and W, writes the input gradient
    total += act_reads
    return 4 * total


def _counted(build, batch, sizes, backward, act_reads):
    import apex

    model, ref, x = build(batch, sizes)
    dy = torch.randn(batch, sizes[-1])
    params = [x, *model.parameters()]
    if backward:
        with apex.backend("triton"):
            y = model(x)
        y_ref = ref(x)
        triton = lambda: torch.autograd.grad(y, params, dy, retain_graph=True)  # noqa: E731
        ref_params = [x, *ref.parameters()]
        eager = lambda: torch.autograd.grad(y_ref, ref_params, dy, retain_graph=True)  # noqa: E731
    else:
        triton = lambda: model(x)  # noqa: E731
        eager = lambda: ref(x)  # noqa: E731
    bare = _gemm_bytes(batch, sizes, backward, 0)
    full = _gemm_bytes(batch, sizes, backward, act_reads)
    return Counted(triton=triton, eager=eager, bytes_min=full,
                   note=f"GEMMs alone (no activation read): {bare} B" if backward else "GEMMs alone")


def cases() -> list[Case]:
    out = []
    db, ds = DLRM_COUNTED
    gb, gs = GPT_COUNTED
    # MLP backward: act' of each layer reads that layer's saved output once (ReLU: y > 0).
    mlp_acts = db * sum(ds[1:])
    # GELU-dense backward: gelu'(h) reads the saved pre-activation once.
    gelu_acts = gb * gs[1]
    out.append(Case("mlp_dlrm_2048x512-256-128_fwd_bwd", timed=lambda: _timed(_mlp, *DLRM),
                    torch_label="nn.Sequential(Linear, ReLU)", repeats=5, warmup=1))
    # bf16 on a CPU without native bf16 GEMMs (AVX2 only here): apex upcasts to fp32 GEMMs.
    out.append(Case("mlp_dlrm_2048x512-256-128_fwd_bwd_bf16",
                    timed=lambda: _timed(_mlp, *DLRM, dtype=torch.bfloat16),
                    torch_label="nn.Sequential(Linear, ReLU) bf16", repeats=3, warmup=1))
    out.append(Case("mlp_dlrm_fwd_64x128-64-32", counted=lambda: _counted(_mlp, db, ds, False, 0)))
    out.append(Case("mlp_dlrm_bwd_64x128-64-32", counted=lambda: _counted(_mlp, db, ds, True, mlp_acts)))
    out.append(Case("gelu_dense_gpt_4096x1024-4096-1024_fwd_bwd", timed=lambda: _timed(_gelu_dense, *GPT),
                    torch_label="nn.Sequential(Linear, GELU(tanh), Linear)", repeats=3, warmup=1))
    out.append(Case("gelu_dense_gpt_fwd_128x64-256-64", counted=lambda: _counted(_gelu_dense, gb, gs, False, 0)))
    out.append(Case("gelu_dense_gpt_bwd_128x64-256-64",
                    counted=lambda: _counted(_gelu_dense, gb, gs, True, gelu_acts)))
    return out
