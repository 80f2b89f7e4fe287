"""The CPU block runner behind the LAMB and NovoGrad PyTorch paths: partition, worker threads, and results
that do not depend on how the lists are cut or on which thread runs a block."""

from __future__ import annotations

import threading

import amp_C
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.ops import _cpu_blocks
from apex.testing import assert_rel_close

# Ragged sizes, all below PyTorch's 32K-element parallel threshold, so every tensor's arithmetic is the
# same whichever thread runs it.
SIZES = [1, 7, 300, 4097, 0, 1000, 5000, 17, 8191, 2049, 3, 9000, 640, 12000, 1, 4500]


@given(st.lists(st.integers(0, 5000), max_size=40), st.integers(1, 6000))
@settings(max_examples=60, deadline=None)
def test_blocks_cover_the_list_in_order(sizes, limit):
    ts = [torch.empty(n) for n in sizes]
    parts = _cpu_blocks.blocks(ts, limit)
    assert [i for part in parts for i in part] == list(range(len(sizes)))
    for part in parts:
        assert part, "no empty blocks"
        assert len(part) == 1 or sum(sizes[i] for i in part) <= limit


def test_blocks_keep_non_cpu_lists_whole():
    ts = [torch.empty(10**6, device="meta"), torch.empty(3, device="meta")]
    assert _cpu_blocks.blocks(ts, 10) == [[0, 1]]


@given(st.lists(st.sampled_from([0, 1, 3, 64, 100, 700]), max_size=40), st.integers(1, 2000))
@settings(max_examples=60, deadline=None)
def test_layout_orders_each_block_by_size_in_classes(sizes, limit):
    layout = _cpu_blocks.Layout(sizes, limit)
    assert sorted(layout.perm) == list(range(len(sizes)))
    parts = _cpu_blocks.blocks([torch.empty(n) for n in sizes], limit)
    assert [sorted(b.order) for b in layout.blocks] == parts
    offset = start = 0
    for b in layout.blocks:
        assert (b.offset, b.start) == (offset, start)
        assert [sizes[i] for i in b.order] == sorted(sizes[i] for i in b.order)
        at = j = 0
        for first, count, n, where in b.classes:
            assert (first, where) == (j, at) and count > 0
            assert all(sizes[i] == n for i in b.order[first:first + count])
            j, at = j + count, at + count * n
        assert (j, at) == (len(b.order), b.numel)
        offset, start = offset + b.numel, start + len(b.order)
    assert layout.numel == offset == sum(sizes)


@pytest.mark.parametrize("with_views", [False, True])
@pytest.mark.parametrize("shapes", [
    [(3, 4), (12,), (0,), (5,), (2, 6), (7,), (0, 3), (5,), (1,), (9,), (40_000,)],  # classes and singles
    [(3,), (2, 4), (17,), (1,)],  # every tensor alone in its class
])
@pytest.mark.parametrize("ord", [2.0, float("inf")])
def test_class_norms_match_one_norm_per_tensor(ord, shapes, with_views):
    ws = _cpu_blocks.Workspace(shapes)
    flat, views = ws.buffer("x")
    gen = torch.Generator().manual_seed(0)
    flat.copy_(torch.randn(flat.numel(), generator=gen))
    for pos, i in enumerate(ws.layout.perm):
        assert views[pos].shape == shapes[i]
    for b in ws.layout.blocks:
        vs = views[b.start:b.start + len(b.order)] if with_views else None
        out = _cpu_blocks.class_norms(flat[b.offset:b.offset + b.numel], b, torch.full((len(b.order),), -1.0),
                                      ord, views=vs)
        expected = [torch.linalg.vector_norm(views[b.start + j].double(), ord) if views[b.start + j].numel()
                    else torch.zeros((), dtype=torch.float64) for j in range(len(b.order))]
        assert_rel_close(out, torch.stack(expected))
    assert any(b.singles for b in ws.layout.blocks)  # the foreach branch is exercised


def test_class_norms_of_long_tensors_keep_fp32_accuracy(monkeypatch):
    """Long same-sized tensors are normed in pieces (``_cpu_norms.row_norms``), not with PyTorch's
    one-accumulator CPU norm, which is off by about 4e-4 at 10M elements."""
    monkeypatch.setattr(_cpu_blocks, "BLOCK_ELEMENTS", 1 << 30)
    n = 5_000_011
    ws = _cpu_blocks.Workspace([(n,), (n,), (7,)])
    flat, views = ws.buffer("x")
    flat.copy_(torch.randn(flat.numel(), generator=torch.Generator().manual_seed(0)) + 0.5)
    (block,) = ws.layout.blocks
    out = _cpu_blocks.class_norms(flat, block, torch.empty(3))
    assert_rel_close(out, torch.stack([torch.linalg.vector_norm(v.double()) for v in views]), tol=1e-6)


def test_workspace_reuses_its_buffers_and_scalar_views():
    ws = _cpu_blocks.Workspace.of([torch.empty(3, 2), torch.empty(5)])
    assert ws.fits([torch.ones(3, 2), torch.ones(5)])
    assert not ws.fits([torch.ones(6), torch.ones(5)]) and not ws.fits([torch.ones(3, 2)])
    assert ws.buffer("u")[0] is ws.buffer("u")[0]
    vec, views = ws.scalars("r")
    vec.copy_(torch.tensor([2.0, 3.0]))
    assert [float(v) for v in views] == [2.0, 3.0] and all(v.dim() == 0 for v in views)
    assert ws.perm_index().tolist() == ws.layout.perm == [1, 0]  # the 5-element tensor first


def test_workers_setting(monkeypatch):
    monkeypatch.setenv("APEX_CPU_WORKERS", "0")
    assert _cpu_blocks.workers() == 0
    monkeypatch.setenv("APEX_CPU_WORKERS", "3")
    assert _cpu_blocks.workers() == 3
    for bad in ("two", "-1"):
        monkeypatch.setenv("APEX_CPU_WORKERS", bad)
        with pytest.raises(ValueError, match="APEX_CPU_WORKERS"):
            _cpu_blocks.workers()


def test_run_returns_results_in_order_and_uses_single_threaded_workers(monkeypatch):
    monkeypatch.setenv("APEX_CPU_WORKERS", "2")
    monkeypatch.setattr(_cpu_blocks, "BLOCK_ELEMENTS", 100)
    before = torch.get_num_threads()
    ts = [torch.empty(n) for n in (5, 200, 40, 70, 10, 300)]
    parts = _cpu_blocks.blocks(ts)

    def where(ts):
        return [t.numel() for t in ts], threading.current_thread().name, torch.get_num_threads()

    out = _cpu_blocks.run(where, parts, ts)
    assert [n for sizes, _, _ in out for n in sizes] == [5, 200, 40, 70, 10, 300]
    by_thread = {tuple(sizes): (name, threads) for sizes, name, threads in out}
    # One-tensor blocks of at least BLOCK_ELEMENTS stay on the calling thread, with all its threads.
    assert by_thread[(200,)] == (threading.current_thread().name, before)
    small = [v for k, v in by_thread.items() if k not in ((200,), (300,))]
    assert small and all(name == "apex-cpu-worker" and threads == 1 for name, threads in small)
    assert torch.get_num_threads() == before


def test_worker_errors_reach_the_caller(monkeypatch):
    monkeypatch.setenv("APEX_CPU_WORKERS", "2")
    ts = [torch.empty(4) for _ in range(6)]

    def fail(ts):
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        _cpu_blocks.run(fail, [[0, 1], [2, 3], [4, 5]], ts)


def test_workers_take_the_callers_grad_mode(monkeypatch):
    monkeypatch.setenv("APEX_CPU_WORKERS", "2")
    ts = [torch.ones(3, requires_grad=True) for _ in range(4)]

    def bump(ts):
        torch._foreach_add_(ts, 1.0)

    with pytest.raises(RuntimeError, match="leaf Variable"):
        _cpu_blocks.run(bump, [[0, 1], [2, 3]], ts)
    with torch.no_grad():
        _cpu_blocks.run(bump, [[0, 1], [2, 3]], ts)
    assert all(bool((t == 2).all()) for t in ts)


def test_workers_take_the_callers_inference_mode_and_keep_ordinary_scratch(monkeypatch):
    monkeypatch.setenv("APEX_CPU_WORKERS", "2")
    ts = [torch.ones(3) for _ in range(4)]

    def probe(ts):
        _cpu_blocks.scratch(5).zero_()
        return torch.is_inference_mode_enabled(), _cpu_blocks.scratch(5).is_inference()

    monkeypatch.setattr(_cpu_blocks._LOCAL, "scratch", None, raising=False)
    with torch.inference_mode():
        assert not _cpu_blocks.scratch(5).is_inference()  # made here, kept for later calls
        inside = _cpu_blocks.run(probe, [[0, 1], [2, 3]], ts)
    assert inside == [(True, False), (True, False)]
    assert _cpu_blocks.run(probe, [[0, 1], [2, 3]], ts) == [(False, False), (False, False)]


def test_a_run_inside_a_worker_runs_inline(monkeypatch):
    monkeypatch.setenv("APEX_CPU_WORKERS", "2")
    ts = [torch.full((2,), float(i)) for i in range(4)]

    def outer(ts):
        return sum(_cpu_blocks.run(lambda xs: float(sum(x.sum() for x in xs)), [[0], [1]], ts[:2] * 1))

    out = _cpu_blocks.run(outer, [[0, 1], [2, 3]], ts)
    assert out == [2.0, 10.0]


def _lamb_lists(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(n, generator=gen) * (0.1 if k >= 2 else 1.0) for n in SIZES] for k in range(4)]


def _lamb_step(lists, wd, mode=1):
    lists[3] = [v.abs() for v in lists[3]]
    norm = torch.linalg.vector_norm(torch.cat([g.float() for g in lists[0]]))
    amp_C.multi_tensor_lamb(2048, torch.zeros(1, dtype=torch.int32), lists, 1e-2, 0.9, 0.999, 1e-6, 3, 1, wd,
                            1, mode, norm.reshape(1), 1.0, False)
    return lists


def _novograd_step(lists):
    g, p, m = lists[:3]
    norms = torch.rand(len(g), generator=torch.Generator().manual_seed(1)) + 0.5
    amp_C.multi_tensor_novograd(2048, torch.zeros(1, dtype=torch.int32), [g, p, m], norms, 1e-2, 0.95, 0.98,
                                1e-8, 3, 1, 0.01, 1, 1, 2)
    return [p, m, [norms]]


@pytest.mark.parametrize("op", ["lamb", "lamb_no_decay", "lamb_l2_mode", "lamb_bf16", "novograd"])
@pytest.mark.parametrize("block", [1, 700, 10_000])
def test_results_do_not_depend_on_blocks_or_workers(monkeypatch, op, block):
    def run(block_elements, workers):
        monkeypatch.setattr(_cpu_blocks, "BLOCK_ELEMENTS", block_elements)
        monkeypatch.setenv("APEX_CPU_WORKERS", str(workers))
        lists = _lamb_lists()
        with torch.no_grad():
            if op == "novograd":
                return _novograd_step(lists)
            if op == "lamb_bf16":  # the generic path, one block of fp32 copies at a time
                lists = [[t.bfloat16() for t in lst] for lst in lists]
            return _lamb_step(lists, 0.0 if op == "lamb_no_decay" else 0.01, 0 if op == "lamb_l2_mode" else 1)[1:]

    whole = run(10**9, 0)
    for workers in (0, 2):
        got = run(block, workers)
        for a, b in zip(got, whole):
            for x, y in zip(a, b):
                assert torch.equal(x, y)


def test_lamb_blocked_with_workers_matches_float64():
    """The blocked, threaded path still computes LAMB (checked against one float64 step)."""
    lists = _lamb_lists(seed=3)
    ref = [[t.double() for t in lst] for lst in lists]
    ref[3] = [v.abs() for v in ref[3]]
    with torch.no_grad():
        _cpu_blocks.BLOCK_ELEMENTS, saved = 500, _cpu_blocks.BLOCK_ELEMENTS
        try:
            out = _lamb_step(lists, 0.01)
        finally:
            _cpu_blocks.BLOCK_ELEMENTS = saved
    g, p, m, v = ref
    gn = torch.linalg.vector_norm(torch.cat(g))
    clip = gn if gn > 1.0 else 1.0
    for i in range(len(p)):
        gi = g[i] / clip
        mi = 0.9 * m[i] + 0.1 * gi
        vi = 0.999 * v[i] + 0.001 * gi * gi
        u = (mi / (1 - 0.9 ** 3)) / ((vi / (1 - 0.999 ** 3)).sqrt() + 1e-6) + 0.01 * p[i]
        pn, un = p[i].norm(), u.norm()
        ratio = pn / un if pn > 0 and un > 0 else 1.0
        expected = p[i] - 1e-2 * ratio * u
        if expected.numel():
            assert_rel_close(out[1][i], expected)
            assert_rel_close(out[2][i], mi)


def test_more_workers_add_threads_without_leaving_idle_ones(monkeypatch):
    def workers_alive():
        return sum(t.name == "apex-cpu-worker" for t in threading.enumerate())

    ts = [torch.ones(2) for _ in range(8)]
    parts = [[i] for i in range(8)]
    for n in (2, 3, 5, 3):
        monkeypatch.setenv("APEX_CPU_WORKERS", str(n))
        names = _cpu_blocks.run(lambda xs: threading.get_ident(), parts, ts)
        assert len(set(names)) == n
    # The pool grew to 5 (or more, for an earlier test in this process) and every thread is still in it.
    assert workers_alive() == len(_cpu_blocks._POOL.get(1).queues) >= 5
