"""The ZeRO optimizers' Gloo reduce-scatter (one all-to-all, then the sum in rank order), all-gather (one
batch of point-to-point transfers, or one all-to-all on two ranks) and small all-reduce (gathered, reduced
locally) against ``torch.distributed``'s own collectives, on 2, 3 and 4 Gloo ranks and on a subgroup, with
several collectives in flight at once."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from apex.contrib.optimizers import _gloo_collectives as pc
from apex.testing.distributed import run_distributed
from apex.testing.numerics import assert_rel_close


def _inputs(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * salt + rank)
    return torch.randn(n, generator=g).to(dtype)


def _expected_reduce_scatter(world: int, rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank-order sum of every rank's chunk ``rank``, in ``dtype`` (what the Gloo path promises)."""
    chunks = [_inputs(r, n * world, dtype, salt).view(world, n)[rank] for r in range(world)]
    out = chunks[0] + chunks[1]
    for c in chunks[2:]:
        out += c
    return out


def _collectives(rank: int, world: int) -> None:
    assert dist.get_backend() == "gloo"
    for dtype in (torch.float32, torch.bfloat16):
        n = 37  # ragged, odd
        x = _inputs(rank, n * world, dtype)
        keep = x.clone()
        ours = torch.empty(n, dtype=dtype)
        pc.reduce_scatter_tensor(ours, x)
        assert torch.equal(ours, _expected_reduce_scatter(world, rank, n, dtype))
        assert torch.equal(x, keep), "the input must not change"
        if dtype == torch.float32:
            theirs = torch.empty(n, dtype=dtype)
            dist.reduce_scatter_tensor(theirs, x.clone())
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
            avg = torch.empty(n, dtype=dtype)
            pc.reduce_scatter_tensor(avg, x, op=dist.ReduceOp.AVG)
            exact = sum(_inputs(r, n * world, torch.float64).view(world, n)[rank] for r in range(world)) / world
            assert_rel_close(avg, exact, tol=1e-7, name="average")
            assert (avg - ours / world).abs().max() <= 1e-6 * ours.abs().max()
            y = x.clone()
            pc.reduce_scatter_tensor(y.view(world, n)[rank], y, op=dist.ReduceOp.AVG)
            assert torch.equal(y.view(world, n)[rank], avg)

        # In place: the output is this rank's own chunk of the input (a rank past the first two adds its own
        # chunk after the others have been summed into it).
        y = _inputs(rank, n * world, dtype).clone()
        pc.reduce_scatter_tensor(y.view(world, n)[rank], y)
        assert torch.equal(y.view(world, n)[rank], _expected_reduce_scatter(world, rank, n, dtype))

        shard = _inputs(rank, n, dtype, salt=7)
        gathered = torch.full((n * world,), float("nan"), dtype=dtype)
        pc.all_gather_into_tensor(gathered, shard)
        assert torch.equal(gathered, torch.cat([_inputs(r, n, dtype, salt=7) for r in range(world)]))

        # In place: the input is this rank's part of the output.
        inplace = torch.full((n * world,), float("nan"), dtype=dtype)
        inplace.view(world, n)[rank].copy_(shard)
        pc.all_gather_into_tensor(inplace, inplace.view(world, n)[rank])
        assert torch.equal(inplace, gathered)

    # Several in flight (as the optimizer's buckets are), finished in reverse order, with reused scratch.
    sizes = [5, 64, 1]
    outs = [torch.empty(s) for s in sizes]
    scratch = [torch.empty(s * world) for s in sizes]
    works = [pc.reduce_scatter_tensor(o, _inputs(rank, s * world, torch.float32, salt=i), async_op=True,
                                      scratch=sc)
             for i, (o, s, sc) in enumerate(zip(outs, sizes, scratch))]
    gathers = [torch.empty(s * world) for s in sizes]
    gworks = [pc.all_gather_into_tensor(g, _inputs(rank, s, torch.float32, salt=20 + i), async_op=True)
              for i, (g, s) in enumerate(zip(gathers, sizes))]
    for w in reversed(works + gworks):
        assert w.wait()
        assert w.is_completed()
    for i, (o, s) in enumerate(zip(outs, sizes)):
        assert torch.equal(o, _expected_reduce_scatter(world, rank, s, torch.float32, salt=i))
    for i, (g, s) in enumerate(zip(gathers, sizes)):
        assert torch.equal(g, torch.cat([_inputs(r, s, torch.float32, salt=20 + i) for r in range(world)]))

    # A subgroup of ranks 1..world-1 (global ranks differ from group ranks).
    members = list(range(1, world))
    sub = dist.new_group(members)
    if rank in members and len(members) > 1:
        m = len(members)
        norm = torch.tensor([float(rank)])
        pc.all_reduce(norm, group=sub)
        assert norm.item() == sum(members)
        x = torch.arange(4 * m, dtype=torch.float32) + 100 * rank
        out = torch.empty(4)
        pc.reduce_scatter_tensor(out, x, group=sub)
        me = members.index(rank)
        assert torch.equal(out, sum(torch.arange(4 * m, dtype=torch.float32)[4 * me:4 * me + 4] + 100 * r
                                    for r in members))
        full = torch.empty(2 * m)
        pc.all_gather_into_tensor(full, torch.full((2,), float(rank)), group=sub)
        assert torch.equal(full, torch.tensor([float(r) for r in members for _ in range(2)]))
    dist.barrier()

    # Small all-reduces (gathered, reduced locally): torch.distributed's result, the same bits on every rank.
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MIN, dist.ReduceOp.MAX):
        for t in (_inputs(rank, 15, torch.float32, salt=30).view(3, 5), torch.tensor([rank + 1], dtype=torch.int32)):
            ours, theirs = t.clone(), t.clone()
            pc.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=op)
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
            everyone = torch.empty([world * ours.numel()], dtype=ours.dtype)
            dist.all_gather_into_tensor(everyone, ours.reshape(-1))
            assert all(torch.equal(row, ours.reshape(-1)) for row in everyone.view(world, -1))
    big = _inputs(rank, pc._SMALL + 3, torch.float32, salt=31)  # beyond the gathered size: Gloo's own
    expected = sum(_inputs(r, pc._SMALL + 3, torch.float32, salt=31) for r in range(world))
    pc.all_reduce(big)
    torch.testing.assert_close(big, expected, rtol=1e-5, atol=1e-5)

    # Bad sizes: a clear error before anything is sent, on every rank alike.
    with pytest.raises(ValueError, match="world_size"):
        pc.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world + 1))
    with pytest.raises(ValueError, match="world_size"):
        pc.all_gather_into_tensor(torch.empty(3 * world), torch.empty(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous"):
        pc.reduce_scatter_tensor(torch.empty(3), torch.empty(3 * world, 2)[:, 0])
    # The collectives still line up after the refused calls.
    out = torch.empty(2)
    pc.reduce_scatter_tensor(out, torch.ones(2 * world))
    assert torch.equal(out, torch.full((2,), float(world)))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gloo_reduce_scatter_and_all_gather(world):
    run_distributed(_collectives, world, timeout_s=60)


def test_other_ops_and_backends_use_torch_distributed(monkeypatch):
    """A max reduce-scatter or a product all-reduce (which the Gloo paths do not do) goes to
    torch.distributed, as does any non-Gloo group."""
    calls = []
    monkeypatch.setattr(pc, "_dist_reduce_scatter", lambda *a, **k: calls.append(("rs", k["op"])))
    monkeypatch.setattr(pc, "_dist_all_gather", lambda *a, **k: calls.append(("ag", None)))
    monkeypatch.setattr(pc.dist, "get_backend", lambda group=None: "nccl")
    pc.reduce_scatter_tensor(torch.empty(2), torch.empty(4))
    pc.all_gather_into_tensor(torch.empty(4), torch.empty(2))
    monkeypatch.setattr(pc.dist, "get_backend", lambda group=None: "gloo")
    pc.reduce_scatter_tensor(torch.empty(2), torch.empty(4), op=dist.ReduceOp.MAX)
    assert calls == [("rs", dist.ReduceOp.SUM), ("ag", None), ("rs", dist.ReduceOp.MAX)]
    # all_reduce: Gloo's own for an op it cannot gather (a product), and on any other backend.
    monkeypatch.setattr(pc.dist, "all_reduce", lambda t, op=None, group=None: calls.append(("ar", op)))
    pc.all_reduce(torch.ones(3), op=dist.ReduceOp.PRODUCT)
    monkeypatch.setattr(pc.dist, "get_backend", lambda group=None: "nccl")
    pc.all_reduce(torch.ones(3))
    assert calls[3:] == [("ar", dist.ReduceOp.PRODUCT), ("ar", dist.ReduceOp.SUM)]
