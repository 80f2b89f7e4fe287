"""apex.contrib.openfold_triton: the auto-tuning cache helpers and the GPU kernels compiled for an H100 target.
LayerNorm, attention and FusedAdamSWA: tests/ops/test_openfold_{layer_norm,attention,adam_swa}.py."""

from __future__ import annotations

import io

import pytest

from apex.contrib.openfold_triton import (
    _load_triton_auto_tune_cache,
    _save_triton_auto_tune_cache,
    sync_triton_auto_tune_cache_across_gpus,
)
from apex.testing import run_distributed


# ------------------------------------------------------------------------------------ auto-tune caches
def test_auto_tune_cache_save_load_roundtrip_and_errors():
    import triton

    from apex._backend import interpreting
    from apex.contrib.openfold_triton import _tuneable_triton_kernels as kernels

    assert set(kernels) == {"_ln_fwd", "_ln_bwd"}
    # One fixed config under the interpreter, which cannot benchmark; the tuning space where kernels compile.
    assert all((len(fn.configs) == 1) == interpreting() for fn in kernels.values())
    saved = {name: dict(fn.cache) for name, fn in kernels.items()}
    try:
        kernels["_ln_fwd"].cache[(64, 128)] = triton.Config({"ROWS": 4}, num_warps=2)
        # Saving refuses a kernel with several configs and no tuned entry (as Apex's does): on a GPU that is
        # _ln_bwd unless a backward ran earlier in this process. Give it one, so the case does not depend on
        # which tests ran before it.
        kernels["_ln_bwd"].cache[(64, 128)] = triton.Config({"ROWS": 2}, num_warps=4)
        buf = io.BytesIO()
        _save_triton_auto_tune_cache(buf)
        kernels["_ln_fwd"].cache = {}
        buf.seek(0)
        _load_triton_auto_tune_cache(buf)
        assert kernels["_ln_fwd"].cache[(64, 128)].kwargs == {"ROWS": 4}
        assert kernels["_ln_bwd"].cache[(64, 128)].kwargs == {"ROWS": 2}
        bad = io.BytesIO()
        import pickle

        pickle.dump({"_ln_fwd": {}, "nonexistent": {}}, bad)
        bad.seek(0)
        with pytest.raises(ValueError, match="unknown"):
            _load_triton_auto_tune_cache(bad, strict=False)
        assert kernels["_ln_fwd"].cache[(64, 128)].kwargs == {"ROWS": 4}  # unchanged
    finally:
        for name, fn in kernels.items():
            fn.cache = saved[name]


def test_sync_without_process_group_is_a_noop():
    assert sync_triton_auto_tune_cache_across_gpus() is None


def _sync_worker(rank, world_size):
    import triton

    from apex.contrib.openfold_triton import _tuneable_triton_kernels as kernels

    if rank == 0:
        kernels["_ln_bwd"].cache[(96, 256)] = triton.Config({"ROWS": 8}, num_warps=4)
    sync_triton_auto_tune_cache_across_gpus()
    assert kernels["_ln_bwd"].cache[(96, 256)].kwargs == {"ROWS": 8}, rank


def test_sync_broadcasts_rank0_caches_on_gloo():
    run_distributed(_sync_worker, 2, timeout_s=30.0)


# ------------------------------------------------------------------------------- GPU code, compiled only
_COMPILE_SCRIPT = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from apex._kernels import openfold_adam_swa as S, openfold_attention as A, openfold_layer_norm as L

def build(fn, sig, consts):
    sig = dict(sig, **{c: "constexpr" for c in consts})
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

strides = {s: "i32" for s in ["sq_z", "sq_h", "sq_m", "sq_d", "sk_z", "sk_h", "sk_n", "sk_d", "sv_z", "sv_h",
           "sv_n", "sv_d", "sm_z", "sm_h", "sm_m", "sm_n", "sb_z", "sb_h", "sb_m", "sb_n", "H", "NQ", "NK", "D"]}
blocks = {"HAS_MASK": True, "HAS_BIAS": True, "LOW": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_D": 32}
sig = {n: "*bf16" for n in ["q", "k", "v", "mask", "bias", "do"]}
sig.update(lse="*fp32", delta="*fp32", dk="*bf16", dv="*bf16", **strides, scale="fp32", inf="fp32")
build(A._attn_bwd_dkdv, sig, blocks)
sig = {"x_ptr": "*bf16", "w_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*bf16", "mean_ptr": "*fp32",
       "rstd_ptr": "*fp32", **{s: "i32" for s in ["M", "N", "D1", "D2", "S0", "S1", "S2", "SN"]}, "eps": "fp32"}
build(L._ln_fwd.fn, sig, {"HAS_W": True, "HAS_B": True, "BLOCK_N": 128, "ROWS": 8})
sig = {"ptrs": "*i64", "sizes": "*i64", "chunk_tensor": "*i32", "chunk_start": "*i64", "n_tensors": "i32",
       "hyper": "*fp64", "clip_ptr": "*fp64"}
build(S._adam_swa_kernel, sig, {"G_DT": tl.bfloat16, "P_DT": tl.float64, "C_DT": tl.bfloat16, "S_DT": tl.float64,
      "M_DT": tl.float64, "V_DT": tl.float64, "CHUNK": 65536, "BLOCK": 1024, "MODE": 2, "FIRST_AVERAGE": False,
      "CT": tl.float64, "ALIGNED": False, "PARTS": 4})
print("compiled")
"""


def test_gpu_kernels_compile_for_sm90():
    # The GPU-only branches (bf16 tensor-core products, autotuned LayerNorm, fp64 Adam) are never run by the
    # interpreter; compiling them for an H100 target (no GPU needed) at least type-checks them.
    import subprocess
    import sys

    env = dict(__import__("os").environ, TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                       timeout=300)
    if r.returncode != 0 and ("ptxas" in r.stderr or "No such file" in r.stderr):
        pytest.skip(f"no CUDA toolchain for Triton: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
