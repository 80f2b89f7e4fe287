"""Plain-Python, one-parameter-at-a-time implementations of the documented LAMB and NovoGrad rules.

They run in any dtype: float64 gives the reference, a reduced dtype gives the "PyTorch computing in that
dtype" baseline that bounds the error allowed to fp16/bf16 parameters.
"""

from __future__ import annotations

import contextlib
import math

import torch


def lamb(params, grad_seq, groups, *, max_grad_norm=1.0, adam_w_mode=True, use_nvlamb=False,
         dtype=torch.float64):
    """Run LAMB over ``grad_seq`` (a list of per-step gradient lists; None = no gradient).

    ``groups``: list of (indices, hyper-parameter dict) with lr, betas, eps, weight_decay,
    bias_correction, grad_averaging. Returns (params, exp_avgs, exp_avg_sqs)."""
    p = [x.detach().to(dtype).clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for k, grads in enumerate(grad_seq, start=1):
        gs = [None if g is None else g.to(dtype) for g in grads]
        total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in gs if g is not None))
        clip = total / max_grad_norm if total > max_grad_norm else 1.0
        for idx, hp in groups:
            b1, b2 = hp["betas"]
            wd, lr, eps = hp["weight_decay"], hp["lr"], hp["eps"]
            b3 = 1 - b1 if hp["grad_averaging"] else 1.0
            bc1 = 1 - b1 ** k if hp["bias_correction"] else 1.0
            bc2 = 1 - b2 ** k if hp["bias_correction"] else 1.0
            for i in idx:
                if gs[i] is None:
                    continue
                sg = gs[i] / clip
                if not adam_w_mode:
                    sg = sg + wd * p[i]
                m[i] = b1 * m[i] + b3 * sg
                v[i] = b2 * v[i] + (1 - b2) * sg * sg
                u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
                if adam_w_mode:
                    u = u + wd * p[i]
                ratio = lr
                if wd != 0 or use_nvlamb:
                    pn, un = float(p[i].double().norm()), float(u.double().norm())
                    if pn != 0 and un != 0:
                        ratio = lr * pn / un
                p[i] = p[i] - ratio * u
    return p, m, v


def novograd(params, grad_seq, hp, *, reg_inside_moment=False, dtype=torch.float64):
    """Run NovoGrad (one group) over ``grad_seq``. Returns (params, exp_avgs, norms)."""
    p = [x.detach().to(dtype).clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    norms = [None] * len(p)
    b1, b2 = hp["betas"]
    for k, grads in enumerate(grad_seq, start=1):
        b3 = 1 - b1 if hp["grad_averaging"] else 1.0
        bc1 = 1 - b1 ** k if hp["bias_correction"] else 1.0
        bc2 = math.sqrt(1 - b2 ** k) if hp["bias_correction"] else 1.0
        for i, g in enumerate(grads):
            g = g.to(dtype)
            n = float(g.double().abs().max()) if hp["norm_type"] == 0 else float(g.double().norm())
            if norms[i] is None:
                norms[i] = 0.0 if hp["init_zero"] else n
            if hp["norm_type"] == 0:
                norms[i] = b2 * norms[i] + (1 - b2) * n
            else:
                norms[i] = math.sqrt(b2 * norms[i] ** 2 + (1 - b2) * n * n)
            d = norms[i] / bc2 + hp["eps"]
            wd, lr = hp["weight_decay"], hp["lr"]
            if reg_inside_moment:
                m[i] = b1 * m[i] + b3 * (g / d + wd * p[i])
                p[i] = p[i] - lr * (m[i] / bc1)
            else:
                m[i] = b1 * m[i] + b3 * g
                p[i] = p[i] - lr * ((m[i] / bc1) / d + wd * p[i])
    return p, m, norms


@contextlib.contextmanager
def bf16_round_to_nearest():
    """Make the Triton interpreter round fp32 -> bf16 to nearest even, as GPUs do (it truncates)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as itp

    original = itp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            x = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            return itp.TensorHandle(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                    dst_type.scalar)
        return original(self, src, dst_type)

    itp.InterpreterBuilder.cast_impl = cast_impl
    try:
        yield
    finally:
        itp.InterpreterBuilder.cast_impl = original
