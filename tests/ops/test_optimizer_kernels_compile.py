"""The optimizer kernels compile for a real GPU target (sm_90), not only under the interpreter.

The interpreter runs kernels with NumPy semantics and misses compile-time errors (type promotion,
constexpr misuse). Compiling needs no GPU; it runs in a subprocess because this process decorated the
kernels with the interpreter on.
"""

import pytest

from tests._compiled import run_uninterpreted

SCRIPT = r'''
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from apex._kernels import multi_tensor_adagrad as G, multi_tensor_adam as A, multi_tensor_sgd as S

base = {"ptrs": "*i64", "sizes": "*i64", "chunk_tensor": "*i32", "chunk_start": "*i64", "n_tensors": "i32"}
c = "constexpr"
adam = dict(base, noop_flag="*i32", lr_ptr="*fp32", step_ptr="*fp32", inv_scale_ptr="*fp32", lr_value="fp32",
            bc1_value="fp32", bc2_value="fp32", beta1="fp32", beta2="fp32", one_m_b1="fp32", one_m_b2="fp32",
            beta1_lo="fp32", beta2_lo="fp32", eps="fp32", weight_decay="fp32",
            G_DT=c, P_DT=c, M_DT=c, V_DT=c, W_DT=c, CHUNK=c, BLOCK=c, MODE=c, CAPTURABLE=c, BIAS_CORRECTION=c,
            HAS_MASTER=c, ALIGNED=c, PARTS=c)
sgd = dict(base, noop_flag="*i32", grad_norms="*fp32", param_norms="*fp32", lr="fp32", wd="fp32", momentum="fp32",
           one_m_dampening="fp32", scale="fp32", trust_coefficient="fp32", eps="fp32", G_DT=c, W_DT=c, M_DT=c, C_DT=c,
           CHUNK=c, BLOCK=c, HAS_MOMENTUM=c, FIRST_RUN=c, NESTEROV=c, WD_AFTER=c, HAS_COPY=c, LARS=c, ROUND=c,
           ALIGNED=c, PARTS=c)
ada = dict(base, lr="fp32", eps="fp32", weight_decay="fp32", G_DT=c, P_DT=c, H_DT=c, CHUNK=c, BLOCK=c, MODE=c,
           ALIGNED=c, PARTS=c)
f32, bf16, f16 = tl.float32, tl.bfloat16, tl.float16
jobs = [
    (A._adam_kernel, adam, dict(G_DT=bf16, P_DT=bf16, M_DT=f32, V_DT=f32, W_DT=f32, CHUNK=65536, BLOCK=1024,
                                MODE=1, CAPTURABLE=True, BIAS_CORRECTION=True, HAS_MASTER=True, ALIGNED=False,
                                PARTS=1)),
    (A._adam_kernel, adam, dict(G_DT=f32, P_DT=f32, M_DT=f32, V_DT=f32, W_DT=f32, CHUNK=65536, BLOCK=1024,
                                MODE=0, CAPTURABLE=False, BIAS_CORRECTION=False, HAS_MASTER=False, ALIGNED=False,
                                PARTS=4)),
    (S._sgd_kernel, sgd, dict(G_DT=f16, W_DT=f32, M_DT=f32, C_DT=f16, CHUNK=65536, BLOCK=1024, HAS_MOMENTUM=True,
                              FIRST_RUN=False, NESTEROV=True, WD_AFTER=True, HAS_COPY=True, LARS=True, ROUND=False,
                              ALIGNED=False, PARTS=4)),
    # fp16 parameters without masters: torch.optim.SGD's rounding after each operation.
    (S._sgd_kernel, sgd, dict(G_DT=f16, W_DT=f16, M_DT=f16, C_DT=f16, CHUNK=65536, BLOCK=1024, HAS_MOMENTUM=True,
                              FIRST_RUN=False, NESTEROV=True, WD_AFTER=False, HAS_COPY=False, LARS=False, ROUND=True,
                              ALIGNED=False, PARTS=1)),
    (G._adagrad_kernel, ada, dict(G_DT=bf16, P_DT=bf16, H_DT=bf16, CHUNK=65536, BLOCK=1024, MODE=1, ALIGNED=False,
                                  PARTS=4)),
]
for fn, sig, consts in jobs:
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))
print("compiled", len(jobs))
# A 16-byte-aligned table: every list's 4 elements a thread are one vector access (fp32: 16 bytes, bf16: 8),
# with no shared-memory layout conversion between the 2- and 4-byte lists; unaligned, scalar accesses.
for dts, aligned in (((f32, f32), True), ((bf16, f32), True), ((f32, f32), False)):
    consts = dict(G_DT=dts[0], P_DT=dts[0], M_DT=dts[1], V_DT=dts[1], W_DT=f32, CHUNK=65536, BLOCK=1024, MODE=1,
                  CAPTURABLE=False, BIAS_CORRECTION=True, HAS_MASTER=False, ALIGNED=aligned, PARTS=4)
    k = triton.compile(ASTSource(fn=A._adam_kernel, signature=adam, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32))
    ptx = k.asm["ptx"]
    assert ("ld.global.v4.b32" in ptx or "ld.global.v2.b32" in ptx) == aligned, (dts, aligned)
    assert "bar.sync" not in ptx, (dts, aligned)
print("vectors ok")
'''


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    proc = run_uninterpreted(["-c", SCRIPT], timeout=300)
    assert "compiled 5" in proc.stdout and "vectors ok" in proc.stdout
