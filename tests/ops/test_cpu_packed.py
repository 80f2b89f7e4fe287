"""The packed layout of the CPU LAMB and NovoGrad paths: which tensors are packed, in what order, the
segments of the others, and state kept as views of a packed buffer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex.ops import _cpu_packed


@given(st.lists(st.integers(0, 3 * _cpu_packed.PACK_ELEMENTS // 2), max_size=30))
@settings(max_examples=60, deadline=None)
def test_packed_holds_the_small_tensors_smallest_first(sizes):
    shapes = [torch.Size([n]) for n in sizes]
    pk = _cpu_packed.Packed(shapes)
    limit = _cpu_packed.PACK_ELEMENTS
    assert sorted(pk.perm) == list(range(len(sizes)))
    assert pk.rest == [i for i, n in enumerate(sizes) if n > limit]
    assert sorted(pk.index) == [i for i, n in enumerate(sizes) if n <= limit]
    assert [sizes[i] for i in pk.index] == sorted(sizes[i] for i in pk.index)
    assert pk.numel == sum(sizes[i] for i in pk.index)
    flat, views = pk.buffer("x")
    at = 0
    for i, view in zip(pk.index, views):  # consecutive views, in index order
        assert view.shape == shapes[i] and view.numel() == 0 or view.data_ptr() == flat[at:].data_ptr()
        at += sizes[i]
    if pk.index:  # the classes cover the block: one run of same-sized tensors each
        covered = [j for j, c, n, at in pk.block.classes for j in range(j, j + c)]
        assert covered == list(range(len(pk.index)))
    # The segments cut perm in order: the packed tensors, then runs of the rest.
    assert [i for seg in pk.segments for i in seg.indices] == pk.perm
    positions = list(range(len(sizes)))
    for k, seg in enumerate(pk.segments):
        assert list(seg.take(positions)) == seg.indices == seg.index.tolist()
        assert pk.perm[seg.start:seg.stop] == seg.indices
        if k or not pk.index:
            assert len(seg.indices) == 1 or sum(sizes[i] for i in seg.indices) <= _cpu_packed.SEGMENT_ELEMENTS


def test_packed_adopts_state_as_views_of_its_buffer():
    shapes = [torch.Size([3, 2]), torch.Size([_cpu_packed.PACK_ELEMENTS + 1]), torch.Size([5])]
    pk = _cpu_packed.Packed(shapes)
    state = [torch.randn(s) for s in shapes]
    assert pk.index == [2, 0] and pk.rest == [1]
    assert not pk.holds("m", [state[i] for i in pk.index])  # no buffer yet
    adopted = pk.adopt("m", state)
    assert adopted[1] is state[1]  # a large tensor stays as it is
    assert all(torch.equal(a, b) for a, b in zip(adopted, state))
    assert pk.holds("m", [adopted[i] for i in pk.index])
    flat = pk.buffer("m")[0]
    assert all(adopted[i].data_ptr() >= flat.data_ptr() for i in pk.index)
    assert not pk.holds("m", [adopted[2].clone(), adopted[0]])
    with pytest.raises(RuntimeError, match="expected torch.float32"):
        pk.adopt("m", [torch.zeros(6), state[1], torch.zeros(5)])
