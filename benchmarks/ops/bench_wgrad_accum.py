"""Weight-gradient accumulation ``main_grad += grad_outputᵀ @ input``: CPU time against the unfused
PyTorch composition (``main_grad.add_(grad_output.t() @ input)``, what Megatron-LM does without
``gradient_accumulation_fusion``); Triton bytes and launches.

Counted under the interpreter at K=256 tokens, 96 → 80 features, fp32. Minimum bytes: read input and
grad_output once, read and write main_grad once.
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted

TIMED = (4096, 1024, 1024)  # tokens, in, out
COUNTED = (256, 96, 80)


def _inputs(k, n_in, n_out, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(k, n_in, generator=g).to(dtype), torch.randn(k, n_out, generator=g).to(dtype),
            torch.randn(n_out, n_in, generator=g))


def _unfused(inp, go, mg):
    mg.add_(go.t() @ inp)


def _timed(shape, dtype):
    from apex.ops.wgrad_accum import wgrad_gemm_accum_fp32

    inp, go, mg = _inputs(*shape, dtype=dtype)
    mg2 = mg.clone()
    return (lambda: wgrad_gemm_accum_fp32(inp, go, mg)), (lambda: _unfused(inp, go, mg2))


def _counted(shape):
    from apex.ops.wgrad_accum import wgrad_gemm_accum_fp32

    inp, go, mg = _inputs(*shape)
    mg2 = mg.clone()
    return Counted(triton=lambda: wgrad_gemm_accum_fp32(inp, go, mg), eager=lambda: _unfused(inp, go, mg2),
                   bytes_min=inp.nbytes + go.nbytes + 2 * mg.nbytes,
                   note="eager = main_grad.add_(grad_output.t() @ input)")


def cases() -> list[Case]:
    name = "x".join(map(str, TIMED))
    return [
        Case(f"wgrad_accum_fp32_{name}", timed=lambda: _timed(TIMED, torch.float32), counted=lambda: _counted(COUNTED),
             torch_label="add_(g.t() @ x)"),
        Case(f"wgrad_accum_bf16_in_{name}", timed=lambda: _timed(TIMED, torch.bfloat16),
             torch_label="add_(g.t() @ x) in bf16"),
    ]
