"""``clip_grad_norm_`` on the PyTorch path: the total norm is the correctly rounded fp32 value of the exact
norm, so it, the clipping coefficient and the clipped gradients are the same on every CPU.

An fp32 accumulation would be off by ~1e-6 for a 300K-element half-precision gradient, in an order set by
the CPU's vector width (AVX2 and AVX-512 machines then disagree in the last bits of the norm and, through
the coefficient, of the gradients).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from apex.contrib.clip_grad import clip_grad_norm_
from tests._cpu_capability import probe_under_capabilities

SIZES = (300_001, 4097, 77, 5, 1)
MAX_NORM = 0.54321


def _params(dtypes, seed=0):
    # numpy's generator: torch.randn's values depend on the CPU's vector width, which is what is varied here.
    rng = np.random.default_rng(seed)
    ps = []
    for n, dt in zip(SIZES, dtypes):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dt))
        p.grad = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dt)
        ps.append(p)
    return ps


CASES = {
    "fp16": (torch.float16,) * 5,
    "bf16": (torch.bfloat16,) * 5,
    "fp32": (torch.float32,) * 5,
    "mixed": (torch.float16, torch.float32, torch.bfloat16, torch.float16, torch.float32),
}


def _clip(case: str):
    ps = _params(CASES[case])
    total = clip_grad_norm_(ps, MAX_NORM)
    return total, [p.grad for p in ps]


@pytest.mark.parametrize("case", list(CASES))
def test_norm_correctly_rounded_and_gradients_scaled_once(case):
    before = [p.grad.clone() for p in _params(CASES[case])]
    total, grads = _clip(case)
    # Squares of fp16/bf16/fp32 values are exact in fp64 and fsum adds them exactly: the exact norm,
    # rounded once to fp32, which no summation order changes.
    exact = math.sqrt(math.fsum(float(v) ** 2 for g in before for v in g.double().tolist()))
    assert total.dtype == torch.float32 and total.shape == ()
    assert total.item() == float(np.float32(exact)), (total.item(), exact)
    coef = torch.clamp(MAX_NORM / (total + 1e-6), max=1.0)
    for g, g0 in zip(grads, before):
        assert torch.equal(g, (g0.float() * coef).to(g0.dtype))


_PROBE = """
import json, sys, zlib, torch
from tests.contrib.test_clip_grad_cpu_numerics import CASES, _clip
out = {"capability": torch.backends.cpu.get_cpu_capability()}
for threads in (1, 2):
    torch.set_num_threads(threads)
    for case in CASES:
        total, grads = _clip(case)
        out[f"{threads}:{case}"] = [total.item()] + [zlib.crc32(g.view(torch.uint8).numpy().tobytes()) for g in grads]
json.dump(out, sys.stdout)
"""


def test_same_bits_on_every_cpu_capability_and_thread_count():
    outs = probe_under_capabilities(_PROBE)
    assert outs["default"]["capability"] in ("DEFAULT", "NO AVX")  # (older torch names it so)
    ref_key, ref = None, None
    for cap, out in outs.items():
        for key, value in out.items():
            if key == "capability":
                continue
            case = key.split(":", 1)[1]
            if ref is None:
                ref_key, ref = f"{cap}/{key.split(':')[0]} thread(s)", {}
            want = ref.setdefault(case, value)
            assert value == want, f"{case}: {cap}, {key.split(':')[0]} thread(s) differs from {ref_key}"
