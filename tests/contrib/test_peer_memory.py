"""apex.contrib.peer_memory (PeerMemoryPool, PeerHaloExchanger1d) and the peer_memory_cuda / nccl_p2p_cuda
compatibility modules: on 2 and 3 Gloo ranks the padding rows receive exactly the neighbours' edge rows (zeros
at the group's edges, interior untouched) for explicit NHWC, channels_last and NCHW, H and W splits; a rank
that never joins gives the process group's timeout error, not a hang."""

from __future__ import annotations

import time

import nccl_p2p_cuda
import peer_memory_cuda
import pytest
import torch
import torch.distributed as dist

from apex.contrib.peer_memory import PeerHaloExchanger1d, PeerMemoryPool
from apex.testing import run_distributed
from apex.testing.distributed import stall_rank_one, stalled_outcome

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _case(world: int, rank: int, fmt: str, h_split: bool, hh: int, dtype, seed: int):
    """(this rank's padded tensor with garbage in the padding, the expected tensor after the exchange)."""
    g = torch.Generator().manual_seed(seed)
    extent, other = 2 * hh + 1, 3  # ragged: not a multiple of anything
    nhwc = fmt == "explicit_nhwc"
    # the global tensor in NCHW, then the split dimension
    sizes = [2, 3, extent * world, other] if h_split else [2, 3, other, extent * world]
    full = torch.randn(sizes, generator=g).to(dtype)
    dim = 2 if h_split else 3
    pad = (0, 0, hh, hh) if h_split else (hh, hh)
    want = torch.nn.functional.pad(full, pad).narrow(dim, rank * extent, extent + 2 * hh)
    y = want.clone()
    y.narrow(dim, 0, hh).copy_(torch.randn(y.narrow(dim, 0, hh).shape, generator=g))  # garbage to overwrite
    y.narrow(dim, extent + hh, hh).copy_(torch.randn(y.narrow(dim, 0, hh).shape, generator=g))
    if nhwc:
        y, want = y.permute(0, 2, 3, 1).contiguous(), want.permute(0, 2, 3, 1).contiguous()
    elif fmt == "channels_last":
        y = y.contiguous(memory_format=torch.channels_last)
    return y, want


def _exchanger_checks(rank, world):
    ranks = list(range(world))
    pool = PeerMemoryPool(0, 1 << 16, ranks)
    seed = 0
    for hh in (1, 2):
        ex = PeerHaloExchanger1d(ranks, rank, pool, hh)
        for fmt in ("explicit_nhwc", "channels_last", "nchw"):
            for h_split in (True, False):
                for dtype in DTYPES:
                    seed += 1
                    y, want = _case(world, rank, fmt, h_split, hh, dtype, seed)
                    ex(y, h_split, fmt == "explicit_nhwc", 0)
                    pool.reset()
                    assert torch.equal(y, want), (rank, hh, fmt, h_split, dtype)
                    if fmt == "channels_last":
                        assert y.is_contiguous(memory_format=torch.channels_last)


def _pool_checks(rank, world):
    pool = PeerMemoryPool(300, 1000, [0, world - 1])
    assert (pool.static_size, pool.dynamic_size) == (512, 1024)
    a = pool.allocate_peer_tensors([1, 2, 3, 4], torch.float16, True, True)
    b = pool.allocate_peer_tensors([10], torch.float32, False, True)
    assert len(a) == 2 and a[0].stride() == (24, 1, 8, 2) and pool.dynamic_offset == 256 + 40
    a[0].fill_(1.0)
    b[0].fill_(2.0)
    assert a[0].sum().item() == 24 and b[0].sum().item() == 20  # the regions do not overlap
    with pytest.raises(RuntimeError, match="dynamic peer memory pool exhausted"):
        pool.allocate_peer_tensors([200], torch.float32, False, True)
    assert pool.dynamic_offset == 256 + 40  # nothing allocated
    pool.reset()
    assert pool.dynamic_offset == 0
    s = pool.allocate_peer_tensors([2, 2], torch.int32, False, False)
    assert s[0].dtype == torch.int32 and pool.static_offset == 16
    with pytest.raises(TypeError, match="dtype"):
        pool.allocate_peer_tensors([2], torch.float64, False, False)
    with pytest.raises(ValueError, match="peer_ranks"):
        PeerMemoryPool(0, 0, [world])
    assert PeerMemoryPool(0, 0).peer_ranks == list(range(world))


def _compat_checks(rank, world):
    nccl_id = nccl_p2p_cuda.get_unique_nccl_id(1)
    dist.broadcast(nccl_id, 0)
    handle = nccl_p2p_cuda.init_nccl_comm(nccl_id, rank, world)
    left = rank - 1 if rank > 0 else -1
    right = rank + 1 if rank < world - 1 else -1
    lo = torch.full((1, 1, 3, 2), 10.0 * rank)
    ro = torch.full((1, 1, 3, 2), 10.0 * rank + 1)
    li, ri = nccl_p2p_cuda.left_right_halo_exchange(handle, left, right, lo, ro)
    assert torch.equal(li, torch.full_like(lo, 10.0 * (rank - 1) + 1 if rank > 0 else 0.0))
    assert torch.equal(ri, torch.full_like(lo, 10.0 * (rank + 1) if rank < world - 1 else 0.0))
    li2, ri2 = torch.full_like(lo, float("nan")), torch.full_like(lo, float("nan"))
    nccl_p2p_cuda.left_right_halo_exchange_inplace(handle, left, right, lo, ro, li2, ri2)
    assert torch.equal(li2, li) and torch.equal(ri2, ri)
    with pytest.raises(ValueError, match="my_rank"):
        nccl_p2p_cuda.init_nccl_comm(nccl_id, rank + 1, world)
    # push_pull_halos_1d: neighbours rank -/+ 1, edges zeroed
    ti, bi = torch.full_like(lo, float("nan")), torch.full_like(lo, float("nan"))
    peer_memory_cuda.push_pull_halos_1d(False, True, 0, rank, rank == 0, lo, None, None, ti, rank == world - 1, ro,
                                        None, None, bi)
    assert torch.equal(ti, li) and torch.equal(bi, ri)


def _all_checks(rank, world):
    _exchanger_checks(rank, world)
    _pool_checks(rank, world)
    _compat_checks(rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_halo_exchange_on_gloo_ranks(world):
    run_distributed(_all_checks, world, timeout_s=30.0)


def _stalled_neighbour(rank, world, out_dir):
    ex = PeerHaloExchanger1d([0, 1], rank, None, 1)
    stall_rank_one(rank, out_dir, lambda: ex(torch.randn(1, 2, 5, 3)))


def test_stalled_neighbour_times_out(tmp_path):
    run_distributed(_stalled_neighbour, 2, str(tmp_path), timeout_s=4.0)
    elapsed, outcome = stalled_outcome(tmp_path)
    assert "timed out" in outcome.lower() or "timeout" in outcome.lower(), outcome
    assert elapsed < 12.0  # the group's 4 s timeout, not torch's 30-minute default


# --------------------------------------------------------------------------- one process
def test_single_rank_group_zeroes_both_halos_without_communicating():
    ex = PeerHaloExchanger1d([5], 0, None, 1)  # no process group needed: nothing to send
    y = torch.randn(1, 4, 3, 2)
    inner = y[:, 1:3].clone()
    ex(y, True, True)
    assert torch.equal(y[:, 1:3], inner) and not y[:, 0].any() and not y[:, 3].any()


def test_exchanger_argument_errors():
    with pytest.raises(ValueError, match="rank_in_group"):
        PeerHaloExchanger1d([0, 1], 2, None, 1)
    with pytest.raises(ValueError, match="half_halo"):
        PeerHaloExchanger1d([0, 1], 0, None, 0)
    ex = PeerHaloExchanger1d([0], 0, None, 2)
    y = torch.randn(1, 1, 5, 2)
    before = y.clone()
    with pytest.raises(ValueError, match="at least 6"):
        ex(y)
    assert torch.equal(y, before)
    with pytest.raises(RuntimeError, match="init_process_group"):
        PeerMemoryPool(0, 1024)


def test_peer_memory_cuda_raw_buffers():
    raw = peer_memory_cuda.allocate_raw(2048)
    try:
        v = peer_memory_cuda.blob_view_half(raw + 512, [1, 3, 2, 4], True)
        assert v.dtype == torch.float16 and v.is_contiguous(memory_format=torch.channels_last)
        v.copy_(torch.randn(1, 3, 2, 4))
        flat = peer_memory_cuda.blob_view_half(raw + 512, [24], False)
        assert torch.equal(flat, v.permute(0, 2, 3, 1).reshape(-1))
        i = peer_memory_cuda.blob_view_int(raw, [4], False)
        i.copy_(torch.tensor([1, -2, 3, 4], dtype=torch.int32))
        peer_memory_cuda.zero(raw + 512, 48)
        assert not v.any() and i.tolist() == [1, -2, 3, 4]
        token = peer_memory_cuda.get_raw_ipc_address(raw)
        assert peer_memory_cuda.get_raw_peers(torch.stack([token, token]), 1, raw) == [raw, raw]
        foreign = token.clone()
        foreign[:8] = 0  # another process id
        with pytest.raises(RuntimeError, match="CUDA IPC"):
            peer_memory_cuda.get_raw_peers(torch.stack([token, foreign]), 0, raw)
        with pytest.raises(ValueError, match="allocate_raw"):
            peer_memory_cuda.blob_view_float(raw + 2040, [4], False)
    finally:
        peer_memory_cuda.free_raw(raw)
    with pytest.raises(ValueError, match="allocate_raw"):
        peer_memory_cuda.free_raw(raw)


def test_nccl_p2p_cuda_helpers():
    ids = nccl_p2p_cuda.get_unique_nccl_id(3)
    assert ids.shape == (3, 128) and ids.dtype == torch.uint8
    start = time.monotonic()
    nccl_p2p_cuda.add_delay(2_000_000)  # 2 ms
    assert time.monotonic() - start >= 0.002
    with pytest.raises(ValueError, match="delay"):
        nccl_p2p_cuda.add_delay(-1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        nccl_p2p_cuda.init_nccl_comm(ids[0], 0, 1)
    with pytest.raises(ValueError, match="handle"):
        nccl_p2p_cuda.left_right_halo_exchange(10**6, -1, -1, torch.zeros(1), torch.zeros(1))
