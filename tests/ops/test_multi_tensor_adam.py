"""amp_C.multi_tensor_adam / _capturable / _capturable_master against float64, noop and unscale
semantics, one launch and the minimum bytes on the Triton path."""

import amp_C
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import apex
from apex.testing import TritonTrace, assert_rel_close
from tests.ops._lists import flag, ragged

SIZES = (1, 7, 4097, 65537)
LR, B1, B2, EPS, WD, STEP = 1e-2, 0.9, 0.999, 1e-8, 0.05, 4


def _state(dtype, seed):
    g, p = ragged(dtype, SIZES, seed), ragged(dtype, SIZES, seed + 1)
    m = [x.float() * 0.1 for x in ragged(torch.float32, SIZES, seed + 2)]
    v = [x.float().abs() * 0.1 for x in ragged(torch.float32, SIZES, seed + 3)]
    return g, p, m, v


def _ref(g, p, m, v, mode, bc, inv_scale=1.0, step=STEP):
    g = g.double() * inv_scale
    p, m, v = p.double(), m.double(), v.double()
    if mode == 0:
        g = g + WD * p
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    c1, c2 = (1 - B1 ** step, 1 - B2 ** step) if bc else (1.0, 1.0)
    u = (m / c1) / ((v / c2).sqrt() + EPS)
    if mode == 1:
        u = u + WD * p
    return p - LR * u, m, v


def _call(backend_name, fn, lists, *args):
    if backend_name == "triton":
        with TritonTrace(bounds=True) as tr:
            tr.watch(lists)
            fn(2048 * 32, *args[:1], lists, *args[1:])
        return tr
    fn(2048 * 32, *args[:1], lists, *args[1:])
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode,bc", [(0, 1), (1, 1), (1, 0)])
def test_adam_matches_float64(backend_name, dtype, mode, bc):
    g, p, m, v = _state(dtype, 0)
    refs = [_ref(*t, mode, bc) for t in zip(g, p, m, v)]
    noop = flag()
    tr = _call(backend_name, amp_C.multi_tensor_adam, [g, p, m, v], noop, LR, B1, B2, EPS, STEP, mode, bc, WD)
    if tr is not None:
        assert tr.launches == 1
    for x, mm, vv, (rp, rm, rv) in zip(p, m, v, refs):
        assert_rel_close(x, rp, baseline=rp.to(dtype))
        assert_rel_close(mm, rm, torch.float32)
        assert_rel_close(vv, rv, torch.float32)


@pytest.mark.parametrize("master", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capturable_unscales_writes_grads_back_and_honours_noop(backend_name, master, dtype):
    g, p, m, v = _state(dtype, 5)
    scaled = [(x.float() * 1024).to(dtype) for x in g]
    w = [x.float() for x in p]
    refs = [_ref(gs, pp, mm, vv, 1, 1, inv_scale=1 / 1024) for gs, pp, mm, vv in zip(scaled, w, m, v)]
    lists = [scaled, p, m, v] + ([w] if master else [])
    fn = amp_C.multi_tensor_adam_capturable_master if master else amp_C.multi_tensor_adam_capturable
    lr, step, inv = torch.tensor([LR]), torch.tensor([STEP], dtype=torch.int32), torch.tensor([1 / 1024])
    # A set noop flag: nothing at all is written.
    before = [[t.clone() for t in lst] for lst in lists]
    _call(backend_name, fn, lists, torch.ones(1, dtype=torch.int32), lr, B1, B2, EPS, step, 1, 1, WD, inv)
    for lst, old in zip(lists, before):
        for a, b in zip(lst, old):
            assert torch.equal(a, b)
    tr = _call(backend_name, fn, lists, flag(), lr, B1, B2, EPS, step, 1, 1, WD, inv)
    if tr is not None:
        assert tr.launches == 1
    for gs, orig, x, mm, (rp, rm, _) in zip(scaled, g, p, m, refs):
        assert_rel_close(gs, orig.double(), baseline=orig.double().to(dtype))  # unscaled in place
        assert_rel_close(x, rp, baseline=rp.to(dtype))
        assert_rel_close(mm, rm, torch.float32)
    if master:
        for x, (rp, _, _) in zip(w, refs):
            assert_rel_close(x, rp, torch.float32)
            assert x.dtype == torch.float32


def test_adam_ignores_noop_and_propagates_nonfinite(backend_name):
    g, p, m, v = _state(torch.float32, 9)
    g[2][5] = float("inf")
    noop = torch.ones(1, dtype=torch.int32)
    _call(backend_name, amp_C.multi_tensor_adam, [g, p, m, v], noop, LR, B1, B2, EPS, 1, 1, 1, 0.0)
    assert not torch.isfinite(m[2][5]) and torch.isfinite(p[0]).all()


def test_triton_moves_the_minimum_bytes(triton_device):
    pytest.importorskip("triton")
    g, p, m, v = _state(torch.float32, 3)
    n = sum(x.numel() for x in p)
    with TritonTrace(bounds=True) as tr:
        tr.watch(g, p, m, v)
        import apex

        with apex.backend("triton"):
            amp_C.multi_tensor_adam(2048, flag(), [g, p, m, v], LR, B1, B2, EPS, 3, 1, 1, WD)
    assert tr.launches == 1
    # Every lane reads g, p, m, v once and writes p, m, v once: 28 B per fp32 element.
    assert 28 * n <= tr.bytes_requested <= 1.01 * 28 * n, tr.bytes_requested / n
    assert 28 * n <= tr.bytes_unique <= 1.01 * 28 * n, tr.bytes_unique / n


@pytest.mark.parametrize("lists,err,word", [
    (lambda: [[torch.ones(3)]] * 3, ValueError, "lists"),
    (lambda: [[torch.ones(3)], [torch.ones(3)], [torch.ones(3)], [torch.ones(3, dtype=torch.float16)]],
     TypeError, "share a dtype"),
    (lambda: [[torch.ones(3)], [torch.ones(3)], [torch.ones(4)], [torch.ones(4)]], ValueError, "shape"),
])
def test_bad_lists(backend_name, lists, err, word):
    with pytest.raises(err, match=word):
        amp_C.multi_tensor_adam(2048, flag(), lists(), LR, B1, B2, EPS, 1, 1, 1, 0.0)


@settings(max_examples=12, deadline=None)
@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=5), step=st.integers(1, 50),
       mode=st.sampled_from([0, 1]), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_adam_random_shapes_and_steps(sizes, step, mode, dtype):
    g, p = ragged(dtype, sizes, 11), ragged(dtype, sizes, 12)
    m = [x.float() * 0.1 for x in ragged(torch.float32, sizes, 13)]
    v = [x.float().abs() * 0.1 for x in ragged(torch.float32, sizes, 14)]
    refs = [_ref(*t, mode, 1, step=step) for t in zip(g, p, m, v)]
    amp_C.multi_tensor_adam(2048, flag(), [g, p, m, v], LR, B1, B2, EPS, step, mode, 1, WD)
    for x, mm, (rp, rm, _) in zip(p, m, refs):
        assert_rel_close(x, rp, baseline=rp.to(dtype))
        assert_rel_close(mm, rm, torch.float32)


@pytest.mark.parametrize("mode", [0, 1])
def test_triton_capturable_equals_the_host_step_bit_for_bit_from_zero_moments(triton_device, mode):
    # From zero moments every step adds (1 - beta) * g terms, and the bias corrections of the first steps
    # are small: the capturable kernel must take both exactly as the host computes them (in double, rounded
    # once to fp32), or its parameters drift from the non-capturable step's. (PyTorch's own fused Adam, the
    # CPU path, differs by an ulp between its tensor-lr and float-lr forms, so only the kernel is checked.)
    sizes = (1, 7, 4097)
    host = [ragged(torch.float32, sizes, 20), ragged(torch.float32, sizes, 21)]
    host += [[torch.zeros_like(x) for x in host[1]] for _ in range(2)]
    dev = [[t.clone() for t in lst] for lst in host]
    for step in range(1, 6):
        g = ragged(torch.float32, sizes, 30 + step)
        host[0], dev[0] = [x.clone() for x in g], [x.clone() for x in g]
        with apex.backend("triton"):
            amp_C.multi_tensor_adam(2048, flag(), host, LR, B1, B2, EPS, step, mode, 1, WD)
            amp_C.multi_tensor_adam_capturable(2048, flag(), dev, torch.tensor([LR]), B1, B2, EPS,
                                               torch.tensor([float(step)]), mode, 1, WD, torch.tensor([1.0]))
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), host[1:], dev[1:]):
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"{name}[{i}]: {(x - y).abs().max().item():.3g}"


# ------------------------------------------------------------------------------- 16-byte-aligned tables
@pytest.mark.no_triton_launch("builds launch tables only")
def test_tables_say_when_every_address_and_size_allows_vector_accesses(triton_device):
    """A table is ``aligned`` (the kernel's 4-element vector accesses) only when every address of every list
    is a multiple of 16 bytes and every size of 4 elements; a table whose gradients alone moved
    (``with_first_list``) is re-judged on the new addresses."""
    from apex._kernels import multi_tensor as mt
    from apex._kernels import multi_tensor_adam as A

    def lists(sizes, offset=0, dtype=torch.float32):
        flat = [torch.zeros(sum(sizes) + 64 * len(sizes), dtype=dtype) for _ in range(4)]
        out = []
        for buf in flat:  # each tensor a view at offset elements past a 32-element boundary of its buffer
            views, at = [], 0
            for n in sizes:
                views.append(buf[at + offset:at + offset + n])
                at += -(-(n + offset) // 32) * 32
            assert [t.numel() for t in views] == list(sizes)
            out.append(views)
        return out

    (tab,) = A.tables(lists((64, 4096, 8)))
    assert tab.aligned and tab.rest_aligned
    (tab,) = A.tables(lists((64, 4096, 8), offset=2))  # 8-byte, not 16-byte, addresses
    assert not tab.aligned and not tab.rest_aligned
    (tab,) = A.tables(lists((64, 4098, 8)))  # a size of 2 elements past a multiple of 4
    assert not tab.aligned and not tab.rest_aligned
    (tab,) = A.tables(lists((64, 4096, 8), dtype=torch.bfloat16))
    assert tab.aligned
    g, p, m, v = lists((64, 4096, 8))
    (tab,) = A.tables([g, p, m, v])
    moved = lists((64, 4096, 8), offset=1)[0]  # new gradients at odd addresses
    assert not mt.with_first_list(tab, [t.data_ptr() for t in moved]).aligned
    fresh = [torch.zeros_like(t) for t in g]
    assert mt.with_first_list(tab, [t.data_ptr() for t in fresh]).aligned


@pytest.mark.parametrize("offset", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_on_views_at_any_offset_matches_float64(triton_device, dtype, offset):
    """Tensors that are views into flat buffers at 4-, 8- and 16-byte boundaries (as in a bucketed gradient
    buffer): the aligned table's vector accesses only where every address allows them, the same results."""
    sizes = (4, 4100, 65540, 12)
    gen = torch.Generator().manual_seed(offset)

    def views(dt, scale=1.0, absolute=False):
        buf = torch.randn(sum(sizes) + 4 * len(sizes) + 8, generator=gen).to(dt) * scale
        buf = buf.abs() if absolute else buf
        out, at = [], offset
        for n in sizes:
            out.append(buf[at:at + n])
            at += n + 4
        return out

    g, p = views(dtype), views(dtype)
    m, v = views(torch.float32, 0.1), views(torch.float32, 0.1, absolute=True)
    refs = [_ref(*t, 1, 1) for t in zip(g, p, m, v)]
    with apex.backend("triton"):
        amp_C.multi_tensor_adam(2048 * 32, flag(), [g, p, m, v], LR, B1, B2, EPS, STEP, 1, 1, WD)
    for x, mm, vv, (rp, rm, rv) in zip(p, m, v, refs):
        assert_rel_close(x, rp, baseline=rp.to(dtype))
        assert_rel_close(mm, rm, torch.float32)
        assert_rel_close(vv, rv, torch.float32)


# ------------------------------------------------------------------------ several programs a chunk (mt.parts)
@pytest.mark.parametrize("parts,block", [(2, 1024), (4, 4096), (8, 2048)])
def test_adam_over_several_programs_a_chunk_is_the_same_step(triton_device, parts, block):
    """The launch a measured table may choose for a GPU, ``parts`` programs a chunk each walking its part in
    ``block``-element steps (``apex._kernels.multi_tensor.parts``), updates every element as one program a
    chunk does: the same bits, over ragged sizes whose last chunk holds one element."""
    from apex._kernels import _tuning
    from apex._kernels import multi_tensor as mt
    from apex._kernels import multi_tensor_adam as A

    state = _state(torch.float32, 5)
    runs = []
    for forced in ({}, {"parts": parts, "block": block}):
        lists = [[t.clone() for t in lst] for lst in state]
        with apex.backend("triton"), _tuning.override(A.OP, **forced):
            amp_C.multi_tensor_adam(2048 * 32, flag(), lists, LR, B1, B2, EPS, STEP, 1, 1, WD)
            programs, got_parts, part, got_block, _ = mt.parts(A.OP, mt.table(lists))
        runs.append(lists)
    assert (got_parts, got_block) == (parts, min(block, part)) and programs == got_parts * mt.table(lists).n_chunks
    for a, b in zip(runs[0], runs[1]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
