"""apex.contrib.bottleneck.SpatialBottleneck and its halo exchangers: on 2 and 3 Gloo ranks each holding an H
slice, outputs, input gradients and (all-reduced) parameter gradients against the one-process Bottleneck on
the whole input in float64; every exchanger moves exactly the neighbours' rows, zeros at the group's edges."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from apex.contrib.bottleneck import (
    Bottleneck,
    HaloExchangerAllGather,
    HaloExchangerNoComm,
    HaloExchangerPeer,
    HaloExchangerSendRecv,
    SpatialBottleneck,
)
from apex.contrib.bottleneck.halo_exchangers import HaloPadder
from apex.contrib.peer_memory import PeerMemoryPool
from apex.testing import assert_rel_close, run_distributed


# --------------------------------------------------------------------------- helpers
def _randomize_frozen_bns(module: torch.nn.Module, gen: torch.Generator) -> None:
    for name, buf in module.named_buffers():
        if name.endswith("running_var"):
            buf.copy_(torch.rand(buf.shape, generator=gen) + 0.5)
        else:
            buf.copy_(torch.randn(buf.shape, generator=gen) * 0.3 + (1.0 if name.endswith("weight") else 0.0))


def _exchangers(rank: int, world: int, group, ranks=None):
    """Every exchanger for this rank; ``ranks`` (the split order) defaults to ascending global ranks."""
    ranks = list(range(world)) if ranks is None else ranks
    me = ranks.index(rank)
    pool = PeerMemoryPool(0, 1 << 16, list(range(world)))
    return {
        "allgather_world": HaloExchangerAllGather(ranks, me, None),
        "allgather_group": HaloExchangerAllGather(ranks, me, group),
        "sendrecv": HaloExchangerSendRecv(ranks, me),
        "peer": HaloExchangerPeer(ranks, me, pool, explicit_nhwc=True, numSM=0),
    }


def _halo(rank: int, which: int, shape, layout: str) -> torch.Tensor:
    """A rank's output halo, recognisable: values depend on (rank, which side)."""
    g = torch.Generator().manual_seed(1000 * rank + which)
    t = torch.randn(shape, generator=g)
    if layout == "nchw_view":  # a non-contiguous row of an NCHW tensor
        big = torch.randn(shape[0], shape[1], 4, shape[3], generator=g)
        big[:, :, 2:3].copy_(t)
        return big[:, :, 2:3]
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    return t


# --------------------------------------------------------------------------- exchangers
def _exchanger_checks(rank, world):
    group = dist.new_group(list(range(world)))
    # the split order need not be the global rank order: also run with the ranks reversed
    for ranks in (list(range(world)), list(range(world))[::-1]):
        _exchanges_for_order(rank, world, group, ranks)


def _exchanges_for_order(rank, world, group, ranks):
    me = ranks.index(rank)
    for name, ex in _exchangers(rank, world, group, ranks).items():
        for layout, shape in (("nhwc", (2, 1, 5, 3)), ("nchw_view", (2, 3, 1, 5)), ("channels_last", (2, 3, 1, 4))):
            lo, ro = _halo(rank, 0, shape, layout), _halo(rank, 1, shape, layout)
            want_l = torch.zeros(shape) if me == 0 else _halo(ranks[me - 1], 1, shape, layout)
            want_r = torch.zeros(shape) if me == world - 1 else _halo(ranks[me + 1], 0, shape, layout)
            li, ri = ex.left_right_halo_exchange(lo, ro)
            assert torch.equal(li, want_l) and torch.equal(ri, want_r), (name, layout, rank)
            # in place, into non-contiguous views of a bigger tensor (as the padding rows of an activation)
            big = torch.full((shape[0], shape[1], 3 * shape[2], shape[3]), float("nan"))
            li2, ri2 = big[:, :, :shape[2]], big[:, :, 2 * shape[2]:]
            assert ex.left_right_halo_exchange(lo, ro, li2, ri2) is None
            assert torch.equal(li2, want_l) and torch.equal(ri2, want_r), (name, layout, rank)
            assert torch.equal(lo, _halo(rank, 0, shape, layout))  # outputs untouched


def _padder_checks(rank, world):  # NCHW and explicit NHWC, H and W splits
    ex = HaloExchangerSendRecv(list(range(world)), rank)
    full = torch.randn(2, 3, 4 * world, 5 * world, generator=torch.Generator().manual_seed(7))
    for nhwc in (False, True):
        for h_split in (True, False):
            dim = 2 if h_split else 3
            y = full.narrow(dim, 4 * rank if h_split else 5 * rank, 4 if h_split else 5)
            padded = torch.nn.functional.pad(full, (1, 1, 0, 0) if not h_split else (0, 0, 1, 1))
            want = padded.narrow(dim, (4 if h_split else 5) * rank, (4 if h_split else 5) + 2)
            if nhwc:
                y, want = y.permute(0, 2, 3, 1).contiguous(), want.permute(0, 2, 3, 1)
            got = HaloPadder(ex)(y, 1, nhwc, h_split)
            assert torch.equal(got, want), (nhwc, h_split, rank)


def test_no_comm_exchanger_swaps_locally():
    ex = HaloExchangerNoComm([0, 1], 1)
    lo, ro = torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2)
    li, ri = ex.left_right_halo_exchange(lo, ro)
    assert li is ro and ri is lo
    li2, ri2 = torch.empty_like(lo), torch.empty_like(ro)
    ex.left_right_halo_exchange(lo, ro, li2, ri2)
    assert torch.equal(li2, ro) and torch.equal(ri2, lo)


# --------------------------------------------------------------------------- SpatialBottleneck
# (explicit_nhwc, in, bottleneck, out, stride, rows per rank, W, exchanger, input layout)
CONFIGS = [
    (True, 4, 3, 4, 1, 3, 5, "sendrecv", "nhwc"),
    (False, 3, 2, 5, 2, 4, 6, "peer", "channels_last"),
    (False, 4, 3, 4, 1, 1, 4, "allgather_group", "nchw"),
    (True, 2, 3, 6, 1, 2, 3, "allgather_world", "nhwc"),
]


def _bottleneck_checks(rank, world):
    group = dist.new_group(list(range(world)))
    exchangers = _exchangers(rank, world, group)
    for i, (nhwc, cin, cb, cout, stride, hs, w, ex_name, layout) in enumerate(CONFIGS):
        gen = torch.Generator().manual_seed(100 + i)
        torch.manual_seed(100 + i)  # same weights on every rank
        ref = Bottleneck(cin, cb, cout, stride=stride, explicit_nhwc=nhwc)
        _randomize_frozen_bns(ref, gen)
        h = hs * world
        shape = (2, h, w, cin) if nhwc else (2, cin, h, w)
        x = torch.randn(shape, generator=gen)
        ref64 = Bottleneck(cin, cb, cout, stride=stride, explicit_nhwc=nhwc).double()
        ref64.load_state_dict(ref.state_dict())
        x64 = x.double().requires_grad_()
        y64 = ref64(x64)
        dy = torch.randn(y64.shape, generator=gen)
        y64.backward(dy.double())

        args = (world, rank, None, exchangers[ex_name], 1, False)
        sp = SpatialBottleneck(cin, cb, cout, stride=stride, explicit_nhwc=nhwc, spatial_parallel_args=args)
        sp.load_state_dict(ref.state_dict())
        hdim = 1 if nhwc else 2
        xs = x.narrow(hdim, rank * hs, hs).clone()
        if layout == "channels_last":
            xs = xs.contiguous(memory_format=torch.channels_last)
        xs.requires_grad_()
        ys = sp(xs)
        ho = hs // stride
        ys.backward(dy.narrow(hdim, rank * ho, ho))
        y_all = [torch.empty_like(ys) for _ in range(world)]
        dist.all_gather(y_all, ys.detach().contiguous())
        g_all = [torch.empty_like(xs) for _ in range(world)]
        dist.all_gather(g_all, xs.grad.contiguous())
        tag = f"config {i} rank {rank}"
        assert_rel_close(torch.cat(y_all, hdim), y64, tol=1e-5, name=f"{tag} output")
        assert_rel_close(torch.cat(g_all, hdim), x64.grad, tol=1e-5, name=f"{tag} input grad")
        for (name, p), (_, p64) in zip(sp.named_parameters(), ref64.named_parameters()):
            g = p.grad.clone()
            dist.all_reduce(g)
            assert_rel_close(g, p64.grad, tol=1e-5, name=f"{tag} grad of {name}")


def _all_checks(rank, world):
    _exchanger_checks(rank, world)
    _padder_checks(rank, world)
    _bottleneck_checks(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_exchangers_and_spatial_bottleneck_on_gloo_ranks(world):
    # one spawn per world size: starting ranks dominates the cost on a small machine
    run_distributed(_all_checks, world, timeout_s=30.0)


def test_group_of_one_is_the_bottleneck():
    torch.manual_seed(0)
    ref = Bottleneck(4, 2, 6, stride=2, explicit_nhwc=True)
    sp = SpatialBottleneck(4, 2, 6, stride=2, explicit_nhwc=True)
    sp.load_state_dict(ref.state_dict())
    x = torch.randn(2, 5, 3, 4)
    assert torch.equal(sp(x), ref(x))
    assert [n for n, _ in sp.named_parameters()] == [n for n, _ in ref.named_parameters()]


@pytest.mark.parametrize("args,err", [
    ((2, 0, None, None, 1, False), TypeError),  # no exchanger for a group of 2
    ((2, 2, None, HaloExchangerNoComm([0, 1], 0), 1, False), ValueError),  # rank out of range
    ((2, 0, None, HaloExchangerNoComm([0, 1], 0), 4, False), ValueError),  # spatial_method
    ((0, 0, None, None, 1, False), ValueError),
    ((2, 0, None), ValueError),
])
def test_bad_spatial_parallel_args(args, err):
    with pytest.raises(err):
        SpatialBottleneck(4, 2, 4, spatial_parallel_args=args)


def test_odd_slice_with_stride_two_is_refused():
    sp = SpatialBottleneck(4, 2, 4, stride=2, spatial_parallel_args=(2, 0, None, HaloExchangerNoComm([0, 1], 0), 1,
                                                                        False))
    with pytest.raises(ValueError, match="multiple of the stride"):
        sp(torch.randn(1, 4, 3, 4))


def test_exchanger_arguments_are_checked():
    with pytest.raises(ValueError, match="rank_in_group"):
        HaloExchangerNoComm([0, 1], 2)
    with pytest.raises(ValueError, match="ranks"):
        HaloExchangerNoComm([], 0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        HaloExchangerSendRecv([0, 1], 0)


# --------------------------------------------------------------------------- fast_bottleneck compat
@pytest.mark.parametrize("nhwc,cin,cout,stride", [(True, 4, 4, 1), (False, 3, 5, 2), (True, 4, 6, 1),
                                                  (False, 4, 4, 1)])
def test_fast_bottleneck_forward_backward_match_autograd(nhwc, cin, cout, stride):
    import fast_bottleneck

    torch.manual_seed(3)
    gen = torch.Generator().manual_seed(3)
    block = Bottleneck(cin, 3, cout, stride=stride, explicit_nhwc=nhwc)
    _randomize_frozen_bns(block, gen)
    ref = Bottleneck(cin, 3, cout, stride=stride, explicit_nhwc=nhwc).double()
    ref.load_state_dict(block.state_dict())
    x = torch.randn((2, 6, 5, cin) if nhwc else (2, cin, 6, 5), generator=gen)
    x64 = x.double().requires_grad_()
    y64 = ref(x64)
    dy = torch.randn(y64.shape, generator=gen)
    y64.backward(dy.double())

    bns = [block.bn1, block.bn2, block.bn3] + ([block.downsample[1]] if block.downsample is not None else [])
    sb = [bn.get_scale_bias(nhwc) for bn in bns]
    convs = [block.conv1.weight, block.conv2.weight, block.conv3.weight]
    inputs = [x, *convs, *(s for s, _ in sb[:3]), *(b for _, b in sb[:3])]
    if block.downsample is not None:
        inputs += [block.downsample[0].weight, *sb[3]]
    out1, out2, out3 = fast_bottleneck.forward(nhwc, stride, inputs)
    assert_rel_close(out3, y64, tol=1e-5, name="out3")
    drelu = (out3 > 0) * dy
    g3 = drelu * sb[2][0]
    g4 = drelu * sb[3][0] if block.downsample is not None else drelu
    t_list = [*inputs[:10], g3, g4, out1, out2] + ([block.downsample[0].weight] if block.downsample is not None else [])
    grads = fast_bottleneck.backward(nhwc, stride, t_list)
    want = [x64.grad] + [p.grad for p in (ref.conv1.weight, ref.conv2.weight, ref.conv3.weight)]
    if block.downsample is not None:
        want.append(ref.downsample[0].weight.grad)
    assert len(grads) == len(want)
    for i, (g, w) in enumerate(zip(grads, want)):
        assert g.shape == w.shape
        assert_rel_close(g, w, tol=1e-5, name=f"grad {i}")
