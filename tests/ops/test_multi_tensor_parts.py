"""The element-wise multi-tensor kernels over several programs a chunk (``apex._kernels.multi_tensor.parts``).

A measured table may launch any of them with ``parts`` programs a chunk, each walking its part of the chunk
in ``block``-element steps, where the interpreter's formula takes one program a chunk. Each step here runs
through its public entry on the Triton backend (the ``triton_device`` fixture alone selects no backend: a
test without ``apex.backend("triton")`` would compare PyTorch's path with itself) with both launches and
must give the same bits, over ragged sizes whose last chunk is partial: one element (65537), or spanning a
few parts of eight (65536 + 20000). A part started at the wrong place leaves elements unwritten or written
twice, and fails here.
"""

from __future__ import annotations

import contextlib

import amp_C
import pytest
import torch

import apex
from apex._kernels import _tuning
from apex._kernels import multi_tensor as mt
from apex._kernels import multi_tensor_adagrad as G
from apex._kernels import multi_tensor_axpby as X
from apex._kernels import multi_tensor_lamb as L
from apex._kernels import multi_tensor_novograd as NG
from apex._kernels import multi_tensor_scale as SC
from apex._kernels import multi_tensor_sgd as S
from apex._kernels import openfold_adam_swa as SWA
from apex.optimizers import FusedSGD
from tests.ops._lists import flag, ragged

SIZES = (1, 7, 4097, 65537, 85536)
f32 = torch.float32


def _lists(n: int, dtypes=(f32,), seed: int = 0, positive: tuple = ()) -> list[list[torch.Tensor]]:
    """``n`` ragged lists (list ``i`` of ``dtypes[i]``, the last dtype repeated); lists in ``positive`` hold
    small non-negative values (second moments, Adagrad's sums)."""
    out = []
    for i in range(n):
        dt = dtypes[min(i, len(dtypes) - 1)]
        xs = ragged(f32, SIZES, seed + i)
        out.append([(x.abs() * 0.1 if i in positive else x).to(dt) for x in xs])
    return out


def _sgd(lists):
    amp_C.multi_tensor_sgd(2048, flag(), lists, 0.05, 0.9, 0.1, 0.1, True, False, False, 0.5)


def _fused_sgd(lists):  # the optimizer's held tables (multi_tensor_sgd.run), not the amp_C entry
    params = [torch.nn.Parameter(p) for p in lists[1]]
    for p, g in zip(params, lists[0]):
        p.grad = g
    opt = FusedSGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)
    opt.step()
    opt.step()
    lists[1][:] = [p.detach() for p in params]
    lists[2][:] = [opt.state[p]["momentum_buffer"] for p in params]


def _lamb(lists):  # weight decay: the trust ratio, so the moments, norms and apply launches
    amp_C.multi_tensor_lamb(2048, flag(), lists, 1e-2, 0.9, 0.999, 1e-6, 3, 1, 0.01, 1, 1, torch.tensor([2.0]),
                            1.0, False)


def _stages(lists):
    g, p, m, v, u = lists
    amp_C.multi_tensor_lamb_stage1_cuda(2048, flag(), lists, torch.tensor([0.0, 0.01, 0.1, 0.02, 0.03]), 5, 0.9,
                                        0.999, 1e-6, torch.tensor([2.0]), 1.0)
    pn = torch.stack([t.norm() for t in p])
    un = torch.stack([t.norm() for t in u])
    amp_C.multi_tensor_lamb_stage2_cuda(2048, flag(), [p, u], pn, un, 1e-2, 0.01, False)


def _novograd(lists):
    norms = torch.tensor([1.0, 2.0, 0.5, 3.0, 4.0])
    amp_C.multi_tensor_novograd(2048, flag(), lists, norms, 1e-2, 0.95, 0.98, 1e-8, 4, 1, 0.01, 1, 0, 2)
    lists.append([norms])


def _adam_swa(lists):
    from apex.ops.openfold_adam_swa import adam_swa_step

    adam_swa_step(*lists, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-3, bias_correction1=0.5,
                  bias_correction2=0.7, swa_decay_rate=0.9, first_average=False, mode=1, grad_scale=0.5)


bf16, f16 = torch.bfloat16, torch.float16
# name: (the op name(s) mt.parts is asked for, the lists' count and dtypes, lists holding positive values, step)
CASES = {
    "sgd": ([S.OP], 4, (f16, f32, f32, f16), (), _sgd),
    "fused sgd": ([S.OP], 3, (f32,), (), _fused_sgd),
    "adagrad": ([G.OP], 3, (f32,), (2,), lambda ls: amp_C.multi_tensor_adagrad(2048, flag(), ls, 0.05, 1e-10, 1,
                                                                                  0.1)),
    "scale": ([SC.OP], 2, (f16, f32), (), lambda ls: amp_C.multi_tensor_scale(2048, flag(), ls, 2.0 ** -3)),
    "axpby": ([X.OP], 3, (f32, f16, f32), (), lambda ls: amp_C.multi_tensor_axpby(2048, flag(), ls, 0.5, -2.0,
                                                                                     -1)),
    "novograd": ([NG.OP], 3, (f32,), (), _novograd),
    "lamb apply": ([L.APPLY_OP], 4, (bf16, f32), (3,), _lamb),
    "lamb stages": ([L.STAGE1_OP, L.STAGE2_OP], 5, (f32,), (3,), _stages),
    "adam swa": ([SWA.OP], 6, (bf16, f32, bf16, f32), (5,), _adam_swa),
}


def _run(name: str, forced: dict) -> list[torch.Tensor]:
    ops, n, dtypes, positive, step = CASES[name]
    lists = _lists(n, dtypes, positive=positive)
    with contextlib.ExitStack() as stack:
        stack.enter_context(apex.backend("triton"))
        for op in ops:
            stack.enter_context(_tuning.override(op, **forced))
            _tuning.last.pop(op, None)
        step(lists)
        for op in ops:  # the launch went through mt.parts (the Triton path) and took the forced configuration
            assert _tuning.last[op] == {**_tuning.last[op], **forced}, (op, _tuning.last.get(op))
    return [t for lst in lists for t in lst]


@pytest.mark.parametrize("parts,block", [(2, 1024), (4, 4096), (8, 2048)])
@pytest.mark.parametrize("name", list(CASES))
def test_several_programs_a_chunk_give_the_same_bits(triton_device, name, parts, block):
    one = _run(name, {"parts": 1})
    split = _run(name, {"parts": parts, "block": block})
    for i, (a, b) in enumerate(zip(one, split, strict=True)):
        assert torch.equal(a, b), f"{name}: tensor {i} differs over {parts} programs a chunk"


def test_the_grid_is_parts_programs_a_chunk():
    """``mt.parts``' answer for a forced configuration: ``parts`` programs for each of the table's chunks, the
    block no longer than a part."""
    lists = _lists(2, (f32,))
    tab = mt.table(lists)
    with _tuning.override(SC.OP, parts=8, block=16384):
        programs, parts, part, block, warps = mt.parts(SC.OP, tab)
    assert (programs, parts, part, block) == (8 * tab.n_chunks, 8, tab.chunk // 8, tab.chunk // 8)
    assert tab.n_chunks == 7 and tab.chunk == 65536
