"""Every multi-tensor kernel but Adam's (tests/ops/test_multi_tensor_adam.py) on tables whose tensors are all
16-byte aligned with sizes of 4 elements (the kernels' 4-element vector accesses: ``ALIGNED``) and on the same
values in views one element into their buffers (element-wise accesses): each launch is told its own table's
``aligned`` (``rest_aligned`` for LAMB's apply launch, which does not read the gradients), and both give the
same bits.

Under the interpreter the hint changes nothing but the launch, so every output is bit-equal. Compiled on a GPU
(``APEX_TEST_DEVICE=cuda``) element-wise outputs stay bit-equal, while a reduction's partial sums follow its
register layout (4 contiguous elements a thread when aligned, 1 otherwise), so the norms and what they scale
(LAMB's trust ratio, LARS, NovoGrad) may differ in the last bits there: compared to a few ulps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch

SIZES = (4, 1028, 12)
N = len(SIZES)
f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def _values(dtype: torch.dtype, seed: int, scale: float = 1.0, absolute: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randn(n, generator=g, dtype=f64) * scale for n in SIZES]
    return [(x.abs() if absolute else x).to(dtype) for x in out]


def _placed(ts: list[torch.Tensor], offset: int) -> list[torch.Tensor]:
    """Copies of ``ts``, each a view ``offset`` elements into a buffer of its own (offset 0: at the
    allocator's alignment, 64 bytes or more; 1: 2, 4 or 8 bytes past it)."""
    out = []
    for t in ts:
        view = torch.zeros(t.numel() + 8, dtype=t.dtype)[offset:offset + t.numel()]
        view.copy_(t)
        out.append(view)
    return out


def _flag() -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32)


@contextlib.contextmanager
def _launch_flags(*kernels) -> Iterator[list[tuple[str, bool]]]:
    """``(kernel name, ALIGNED)`` of every launch of ``kernels`` within the block."""
    seen: list[tuple[str, bool]] = []
    for k in kernels:
        inner = k.run

        def run(*args, _k=k, _inner=inner, **kwargs):
            seen.append((_k.fn.__name__, bool(dict(zip(_k.arg_names, args), **kwargs)["ALIGNED"])))
            return _inner(*args, **kwargs)

        k.run = run  # (an instance attribute, deleted below: the class's run stays whatever it is)
    try:
        yield seen
    finally:
        for k in kernels:
            del k.run


# ------------------------------------------------------------------------------- the cases
# Each makes its inputs at ``offset`` and returns (exact outputs, outputs of a reduction).
def _sgd(dtypes: tuple, lars: bool = False) -> Callable[[int], tuple[list, list]]:
    def case(offset: int) -> tuple[list, list]:
        from apex._kernels import multi_tensor as mt
        from apex._kernels import multi_tensor_l2norm as L2
        from apex._kernels import multi_tensor_sgd as S

        lists = [_placed(_values(dt, i, 0.1 if i == 2 else 1.0), offset) for i, dt in enumerate(dtypes)]
        flag, kw = _flag(), {}
        if lars:  # as FusedLARS: both norms from the update's own table, then the update
            norms = L2.pair_norms(flag, mt.table(lists + [lists[1]]))
            kw = dict(grad_norms=norms[:N], param_norms=norms[N:], trust_coefficient=0.02, eps=1e-8, lars=True)
        S.sgd(flag, lists, lr=0.1, wd=1e-3, momentum=0.9, dampening=0.1, nesterov=True, first_run=False,
              wd_after_momentum=False, scale=0.5, **kw)
        written = [x for lst in lists[1:] for x in lst]
        return ([], [norms, *written]) if lars else (written, [])
    return case


def _sgd_run(offset: int) -> tuple[list, list]:
    """FusedSGD's launch: the kernel over tables it keeps."""
    from apex._kernels import multi_tensor_sgd as S

    lists = [_placed(_values(f32, i), offset) for i in range(3)]
    S.run(S.tables(lists), False, _flag(), lr=0.1, wd=1e-3, momentum=0.9, dampening=0.0, nesterov=False,
          first_run=False, wd_after_momentum=True, scale=1.0)
    return [*lists[1], *lists[2]], []


def _lamb_lists(offset: int, dtypes: tuple) -> list[list[torch.Tensor]]:
    return [_placed(_values(dt, i, 0.1 if i > 1 else 1.0, absolute=i == 3), offset) for i, dt in enumerate(dtypes)]


_LAMB = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, step=3, bias_correction=True, beta3=0.1, adam_w=True,
             max_grad_norm=1.0, use_nvlamb=False)


def _lamb(dtypes: tuple, decay: float, has_out: bool = False) -> Callable[[int], tuple[list, list]]:
    def case(offset: int) -> tuple[list, list]:
        from apex._kernels import multi_tensor_lamb as L

        g, p, m, v = _lamb_lists(offset, dtypes)
        out = _placed([x.to(f16) for x in p], offset) if has_out else None
        L.lamb(_flag(), g, p, m, v, out, weight_decay=decay, grad_norm=torch.full((1,), 2.0), **_LAMB)
        written = [*p, *(out or [])]
        # (the trust ratio scales p by a norm; the moments are element-wise)
        return ([*m, *v], written) if decay else ([*m, *v, *written], [])
    return case


def _lamb_stages(offset: int) -> tuple[list, list]:
    from apex._kernels import multi_tensor_lamb as L

    g, p, m, v = _lamb_lists(offset, (f32,) * 4)
    u = _placed([torch.zeros_like(x) for x in p], offset)
    L.stage1([g, p, m, v, u], torch.tensor([0.0, 0.01, 0.1]), torch.full((1,), 2.0), 1.0, 0.9, 0.999, 0.1, 0.01,
             1e-6)
    L.stage2([p, u], torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.5, 0.0, 3.0]), 1e-2, True)
    return [*m, *v, *u, *p], []


def _novograd(max_norm: bool) -> Callable[[int], tuple[list, list]]:
    def case(offset: int) -> tuple[list, list]:
        from apex._kernels import multi_tensor as mt
        from apex._kernels import multi_tensor_novograd as NG

        g, p, m = (_placed(_values(f32, i, 0.1 if i == 2 else 1.0), offset) for i in range(3))
        tab = mt.table([g, p, m])
        norms = torch.tensor([0.5, 1.0, 2.0])
        NG.blend_norms(_flag(), tab, norms, 0.9, 0.1, max_norm)
        NG.update(tab, norms, lr=1e-2, beta1=0.9, beta3=0.1, bc1=0.5, bc2=0.7, eps=1e-8, weight_decay=1e-3,
                  reg_inside_moment=False)
        # (max |g| is exact in any order: then everything is)
        return ([norms, *p, *m], []) if max_norm else ([], [norms, *p, *m])
    return case


def _adagrad(offset: int) -> tuple[list, list]:
    from apex._kernels import multi_tensor_adagrad as G

    g, p, h = (_placed(_values(f32, i, absolute=i == 2), offset) for i in range(3))
    G.adagrad([g, p, h], 0.1, 1e-10, 1, 1e-3)
    return [*p, *h], []


def _axpby(dtypes: tuple) -> Callable[[int], tuple[list, list]]:
    def case(offset: int) -> tuple[list, list]:
        from apex._kernels import multi_tensor_axpby as X

        xs, ys, outs = (_placed(_values(dt, i), offset) for i, dt in enumerate(dtypes))
        xs[1][5] = float("inf")  # flagged
        flag = _flag()
        X.axpby(flag, xs, ys, outs, 2.0, -0.5, 0)
        return [flag, *outs], []
    return case


def _scale(dtypes: tuple, tensor_scale: bool) -> Callable[[int], tuple[list, list]]:
    def case(offset: int) -> tuple[list, list]:
        from apex._kernels import multi_tensor_scale as SC

        ins, outs = (_placed(_values(dt, i), offset) for i, dt in enumerate(dtypes))
        flag = _flag()
        SC.scale(flag, ins, outs, torch.full((1,), 0.25) if tensor_scale else 0.25)
        return [flag, *outs], []
    return case


def _l2norm(dtype: torch.dtype, max_norm: bool, with_outputs: bool) -> Callable[[int], tuple[list, list]]:
    def case(offset: int) -> tuple[list, list]:
        from apex._kernels import multi_tensor_l2norm as L2

        xs = _placed(_values(dtype, 0), offset)
        outs = _placed([torch.zeros(n, dtype=f32) for n in SIZES], offset) if with_outputs else None
        flag = _flag()
        total, per = L2.norms(flag, xs, per_tensor=True, outputs=outs, out_scale=0.5, max_norm=max_norm,
                              inv_scale=torch.full((1,), 0.5))
        exact = [flag, *(outs or [])]
        return (exact + [total, per], []) if max_norm else (exact, [total, per])
    return case


def _l2norm_of_tables(offset: int) -> tuple[list, list]:
    """LAMB's global gradient norm: list 0 of its own tables."""
    from apex._kernels import multi_tensor_l2norm as L2
    from apex._kernels import multi_tensor_lamb as L

    g, p, m, v = _lamb_lists(offset, (f32,) * 4)
    return [], [L2.total_of_tables(_flag(), L.tables(g, p, m, v, None), skip_if_flagged=True)]


def _adam_swa(dtypes: tuple) -> Callable[[int], tuple[list, list]]:
    """OpenFold's Adam + SWA over (g, p, compute copy, swa, m, v); fp64 state beside bf16 lists takes 2
    elements a vector in every list."""
    def case(offset: int) -> tuple[list, list]:
        from apex._kernels import openfold_adam_swa as SWA

        lists = [_placed(_values(dt, i, 0.1 if i > 3 else 1.0, absolute=i == 5), offset) for i, dt in enumerate(dtypes)]
        hyper = torch.tensor([1e-2, 0.9, 0.999, 1e-8, 1e-3, 0.5, 0.7, 0.9], dtype=f64)
        SWA.adam_swa(lists, hyper, torch.full((1,), 0.5, dtype=f64), 1, False)
        return [x for lst in lists[1:] for x in lst], []
    return case


CASES = {
    "sgd fp32": (_sgd((f32, f32, f32)), ["_sgd_kernel"]),
    "sgd fp16 grads, fp32 weights, fp16 copies": (_sgd((f16, f32, f32, f16)), ["_sgd_kernel"]),
    "sgd fp16 rounded": (_sgd((f16, f16, f16)), ["_sgd_kernel"]),
    "sgd held tables": (_sgd_run, ["_sgd_kernel"]),
    "lars": (_sgd((f32, f32, f32), lars=True), ["_pair_partials_kernel", "_sgd_kernel"]),
    "lamb trust ratio": (_lamb((f32,) * 4, 0.01), ["_moments_kernel", "_apply_kernel"]),
    "lamb bf16 with fp16 copies": (_lamb((bf16, bf16, f32, f32), 0.01, True), ["_moments_kernel", "_apply_kernel"]),
    "lamb one pass": (_lamb((f32,) * 4, 0.0), ["_moments_kernel"]),
    "lamb stages": (_lamb_stages, ["_stage1_kernel", "_stage2_kernel"]),
    "novograd l2": (_novograd(False), ["_norm_partials_kernel", "_update_kernel"]),
    "novograd max": (_novograd(True), ["_norm_partials_kernel", "_update_kernel"]),
    "adagrad": (_adagrad, ["_adagrad_kernel"]),
    "axpby fp32": (_axpby((f32, f32, f32)), ["_axpby_kernel"]),
    "axpby fp16 and fp32 into fp16": (_axpby((f16, f32, f16)), ["_axpby_kernel"]),
    "scale fp32": (_scale((f32, f32), False), ["_scale_kernel"]),
    "scale fp32 into fp16 by a tensor": (_scale((f32, f16), True), ["_scale_kernel"]),
    "l2norm per tensor": (_l2norm(f32, False, False), ["_partials_kernel"]),
    "l2norm bf16 with fp32 outputs": (_l2norm(bf16, False, True), ["_partials_kernel"]),
    "l2norm max": (_l2norm(f16, True, False), ["_partials_kernel"]),
    "l2norm of lamb's tables": (_l2norm_of_tables, ["_partials_kernel"]),
    "adam swa fp32": (_adam_swa((bf16, f32, bf16, f32, f32, f32)), ["_adam_swa_kernel"]),
    "adam swa fp64 state": (_adam_swa((bf16, f64, bf16, f64, f64, f64)), ["_adam_swa_kernel"]),
}


def _kernels() -> dict:
    from apex._kernels import multi_tensor_adagrad as G
    from apex._kernels import multi_tensor_axpby as X
    from apex._kernels import multi_tensor_l2norm as L2
    from apex._kernels import multi_tensor_lamb as L
    from apex._kernels import multi_tensor_novograd as NG
    from apex._kernels import multi_tensor_scale as SC
    from apex._kernels import multi_tensor_sgd as S
    from apex._kernels import openfold_adam_swa as SWA

    ks = [S._sgd_kernel, L._moments_kernel, L._apply_kernel, L._stage1_kernel, L._stage2_kernel,
          NG._norm_partials_kernel, NG._update_kernel, G._adagrad_kernel, X._axpby_kernel, SC._scale_kernel,
          L2._partials_kernel, L2._pair_partials_kernel, SWA._adam_swa_kernel]
    return {k.fn.__name__: k for k in ks}


def _same(a: list, b: list, exact: bool) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if exact:
            assert torch.equal(x, y), f"output {i}: {(x.double() - y.double()).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(x, y, rtol=8 * torch.finfo(x.dtype).eps, atol=0.0, msg=f"output {i}")


@pytest.mark.parametrize("name", list(CASES))
def test_aligned_and_misaligned_tables_give_the_same_bits(triton_device, name):
    case, names = CASES[name]
    kernels = _kernels()
    with _launch_flags(*kernels.values()) as aligned:
        exact_a, reduced_a = case(0)
    with _launch_flags(*kernels.values()) as unaligned:
        exact_u, reduced_u = case(1)
    if triton_device.type != "meta":  # (meta tensors have no addresses)
        assert sorted({k for k, _ in aligned}) == sorted(names), aligned
        assert all(flag for _, flag in aligned), aligned
        assert not any(flag for _, flag in unaligned), unaligned
    _same(exact_a, exact_u, True)
    _same(reduced_a, reduced_u, triton_device.type == "cpu")


def test_lamb_apply_keeps_vectors_when_only_the_gradients_moved(triton_device):
    """A held table whose gradients moved to odd addresses (``with_first_list``): the moments launch, which
    reads them, goes element-wise, the apply launch (parameters and moments only) keeps the vectors, and
    the step is the one on a table of fresh tensors."""
    from apex._kernels import multi_tensor as mt
    from apex._kernels import multi_tensor_lamb as L

    def step(moved: bool) -> list[torch.Tensor]:
        g, p, m, v = _lamb_lists(0, (f32,) * 4)
        (tab,) = L.tables([torch.zeros_like(x) for x in g], p, m, v, None)  # the table of an earlier step
        if moved:
            g = _placed(g, 1)
        tab = mt.with_first_list(tab, [x.data_ptr() for x in g])
        with _launch_flags(L._moments_kernel, L._apply_kernel) as seen:
            L.lamb_on(_flag(), [tab], has_out=False, weight_decay=0.01, grad_norm=torch.full((1,), 2.0), **_LAMB)
        if triton_device.type != "meta":
            assert seen == [("_moments_kernel", not moved), ("_apply_kernel", True)], seen
        return [*p, *m, *v]

    _same(step(False), step(True), triton_device.type == "cpu")
