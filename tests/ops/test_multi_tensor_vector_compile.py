"""The multi-tensor kernels but Adam's (tests/ops/test_optimizer_kernels_compile.py) compiled for sm_90 through
their own launchers: on tensors at 16-byte addresses with sizes of 4 elements, the PTX reads (and, where the
kernel writes tensors, writes) them with vector accesses, and no more barriers than element-wise (a layout
conversion between lists would add some); on views one element into their buffers, no vector access at all.

Runs in a subprocess: compiling needs ``TRITON_INTERPRET`` unset before the kernels are imported.
"""

import pytest

from tests._compiled import run_uninterpreted

SCRIPT = r'''
import re
import torch
from apex._kernels import multi_tensor as mt, multi_tensor_adagrad as G, multi_tensor_axpby as X
from apex._kernels import multi_tensor_l2norm as L2, multi_tensor_lamb as L, multi_tensor_novograd as NG
from apex._kernels import multi_tensor_scale as SC, multi_tensor_sgd as S, openfold_adam_swa as SWA
from apex.testing.occupancy import _PTX_BRANCH, _PTX_LABEL, _loop_bodies, capture

N = 1 << 16  # (a chunk of 65536: 64 passes, a loop the compiler keeps)
f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
flag = lambda: torch.zeros(1, dtype=torch.int32)


def lists(dts, off):
    return [[torch.empty(N + 8, dtype=dt)[off:off + N] for _ in range(3)] for dt in dts]


def novograd(off):
    tab = mt.table(lists((f32,) * 3, off))
    NG.blend_norms(flag(), tab, torch.zeros(3), 0.9, 0.1, False)
    NG.update(tab, torch.zeros(3), lr=1e-3, beta1=0.9, beta3=0.1, bc1=0.5, bc2=0.5, eps=1e-8, weight_decay=0.0,
              reg_inside_moment=False)


def stages(off):
    ls = lists((f32,) * 5, off)
    L.stage1(ls, torch.zeros(3), torch.ones(1), 1.0, 0.9, 0.999, 0.1, 0.01, 1e-6)
    L.stage2([ls[1], ls[4]], torch.ones(3), torch.ones(3), 1e-3, True)


cases = {
    "sgd": lambda off: S.sgd(flag(), lists((f16, f32, f32, f16), off), lr=0.1, wd=1e-4, momentum=0.9,
                             dampening=0.0, nesterov=True, first_run=False, wd_after_momentum=False, scale=1.0),
    "lamb": lambda off: L.lamb(flag(), *lists((bf16, bf16, f32, f32), off), None, lr=1e-3, beta1=0.9, beta2=0.999,
                               eps=1e-6, step=3, bias_correction=True, weight_decay=0.01, beta3=0.1, adam_w=True,
                               grad_norm=torch.ones(1), max_grad_norm=1.0, use_nvlamb=False),
    "lamb stages": stages,
    "novograd": novograd,
    "adagrad": lambda off: G.adagrad(lists((f32,) * 3, off), 0.1, 1e-10, 1, 0.0),
    "axpby": lambda off: X.axpby(flag(), *lists((f16, f32, f16), off), 2.0, 3.0, -1),
    "scale": lambda off: SC.scale(flag(), *lists((f32, f16), off), 0.5),
    "l2norm": lambda off: L2.norms(flag(), lists((f32,), off)[0], per_tensor=True),
    "pair norms": lambda off: L2.pair_norms(flag(), mt.table(lists((f32,) * 4, off))),
    "adam swa": lambda off: SWA.adam_swa(lists((bf16, f32, bf16, f32, f32, f32), off), torch.zeros(8, dtype=f64),
                                         torch.ones(1, dtype=f64), 1, False),
    "adam swa fp64": lambda off: SWA.adam_swa(lists((bf16, f64, bf16, f64, f64, f64), off),
                                              torch.zeros(8, dtype=f64), torch.ones(1, dtype=f64), 1, False),
}
# Kernels that only reduce (their one store a chunk is a scalar), and the helpers that read no table.
READ_ONLY = {"_partials_kernel", "_pair_partials_kernel", "_norm_partials_kernel"}
HELPERS = {"_reduce_kernel", "_finalize_kernel"}
VEC_LD, VEC_ST = re.compile(r"\bld\.global\S*\.v[248]\."), re.compile(r"\bst\.global\S*\.v[248]\.")


def loop_accesses(ptx):
    """(global loads, global stores) in the loop that loads the most: one pass over BLOCK elements."""
    lines = ptx.splitlines()
    ld = [bool(re.search(r"\bld\.global", line)) for line in lines]
    a, b = max(_loop_bodies(lines, _PTX_LABEL, _PTX_BRANCH), key=lambda r: sum(ld[r[0]:r[1] + 1]))
    return sum(ld[a:b + 1]), sum(bool(re.search(r"\bst\.global", line)) for line in lines[a:b + 1])


checked = set()
for name, call in cases.items():
    ptx = {}
    for off in (0, 1):
        with capture("cuda:90") as launches:
            call(off)
        ptx[off] = [(l.name.rsplit(".", 1)[-1], l.kernel.asm["ptx"]) for l in launches]
    # Elements a vector in every list: 4; 2 beside fp64 (adam_swa's _ptr).
    vec = 2 if "fp64" in name else 4
    for (k, aligned), (_, unaligned) in zip(ptx[0], ptx[1]):
        if k in HELPERS:
            continue
        assert VEC_LD.search(aligned), f"{name} {k}: no vector load on an aligned table"
        assert k in READ_ONLY or VEC_ST.search(aligned), f"{name} {k}: no vector store on an aligned table"
        assert not VEC_LD.search(unaligned) and not VEC_ST.search(unaligned), f"{name} {k}: vectors at odd addresses"
        # Every list's accesses, not only some: a pass's loads drop vec-fold, its stores too but for the
        # non-finite flag's (axpby, scale: at most 2, in both).
        (ld_a, st_a), (ld_u, st_u) = loop_accesses(aligned), loop_accesses(unaligned)
        assert ld_u == vec * ld_a, f"{name} {k}: {ld_a} loads a pass aligned, {ld_u} element-wise"
        flags, rest = divmod(vec * st_a - st_u, vec - 1)
        assert rest == 0 and 0 <= flags <= 2, f"{name} {k}: {st_a} stores a pass aligned, {st_u} element-wise"
        bars = [p.count("bar.sync") + p.count("barrier.sync") for p in (aligned, unaligned)]
        assert bars[0] <= bars[1], f"{name} {k}: {bars[0]} barriers aligned, {bars[1]} element-wise"
        checked.add(k)
print("vectors ok", len(checked))
'''


def test_multi_tensor_kernels_vectorise_aligned_tables_for_sm90():
    pytest.importorskip("triton")
    proc = run_uninterpreted(["-c", SCRIPT], timeout=600)
    # every kernel changed: sgd, lamb's moments/apply/stage1/stage2, novograd's two, adagrad, axpby, scale,
    # l2norm's two, adam_swa
    assert "vectors ok 13" in proc.stdout, proc.stdout
