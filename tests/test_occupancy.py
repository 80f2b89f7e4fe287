"""``apex.testing.occupancy``: the occupancy arithmetic against the CUDA occupancy calculator's figures, the
PTX/SASS readers on known snippets, the Little's-law model by hand, and kernels whose compiled facts are
known (compiled for sm_90 in a subprocess: no GPU needed)."""

from __future__ import annotations

import json
import textwrap
from collections import Counter

import pytest

from apex.testing import occupancy as occ
from tests._compiled import run_uninterpreted


def _res(warps=4, regs=32, shared=0, **kw) -> occ.Resources:
    return occ.Resources(kernel="k", num_warps=warps, num_stages=1, regs=regs, local_bytes=0, spill_stores=0,
                         spill_loads=0, shared=shared, **kw)


@pytest.mark.parametrize("warps,regs,shared,want", [
    (4, 32, 0, (16, "warps")),  # 128 threads: 64 warps / 4
    (8, 64, 0, (4, "registers")),  # 256 threads x 64 registers: 4 blocks (the calculator's 50%)
    (4, 40, 0, (12, "registers")),  # 40 -> 1280 per warp: 12 warps per scheduler's quarter, 48 warps
    (1, 255, 0, (8, "registers")),  # 8192 registers a warp: 2 per quarter
    (1, 16, 0, (32, "blocks")),
    (4, 32, 100 * 1024, (2, "shared")),  # 101 KiB + 1 KiB reserved a block: 2 in 228 KiB
    (16, 51, 0, (2, "registers")),  # 16 warps x 56 (allocated) registers: 36 warps fit, 2 blocks
])
def test_occupancy_matches_the_calculator(warps, regs, shared, want):
    assert occ.occupancy(_res(warps, regs, shared), occ.H200) == want


PTX = textwrap.dedent("""
    .visible .entry k(
    .reqntid 128
        @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.b16 %rs1, [ %rd2 + 0 ];
    $L__BB0_2:                              // =>This Inner Loop Header: Depth=1
        @%p2 ld.global.v2.b64 { %rd5, %rd6 }, [ %rd3 + 0 ];
        @%p2 ld.global.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd4 + 0 ];
        bar.sync 0;
        @%p3 st.global.v4.b32 [ %rd7 + 0 ], { %r9, %r10, %r11, %r12 };
        @%p4 bra $L__BB0_2;
        st.global.b32 [ %rd8 + 0 ], { %r13 };
""")


def test_ptx_reader_counts_widths_and_the_loop_body():
    p = occ.parse_ptx(PTX)
    assert p["loads"] == Counter({16: 3, 2: 1}) and p["stores"] == Counter({16: 1, 4: 1})
    # The loop body: one 16-byte pair of b64 and one v4.b32 load, one barrier, one 16-byte store.
    assert p["has_loop"] and p["load_bytes"] == 32 and p["store_bytes"] == 16 and p["barriers"] == 1
    assert p["prefetch"] == 1


def test_ptx_reader_sees_a_pipelined_loop():
    ptx = textwrap.dedent("""
        cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;
        cp.async.commit_group;
        cp.async.cg.shared.global [ %r3 + 0 ], [ %rd2 + 0 ], 0x10, %r4;
        cp.async.commit_group;
    $L__BB0_2:
        cp.async.wait_group 1;
        cp.async.cg.shared.global [ %r5 + 0 ], [ %rd3 + 0 ], 0x10, %r6;
        cp.async.commit_group;
        @%p1 bra $L__BB0_2;
    """)
    p = occ.parse_ptx(ptx)
    # The prologue's copies prefetch the loop's passes: the body (one 16-byte copy) is the pass.
    assert p["has_loop"] and p["load_bytes"] == 16 and p["prefetch"] == 2


def test_a_library_loop_is_not_the_pass():
    # sin's range reduction loops over a 4-byte table; the kernel's data loads are outside any loop.
    ptx = textwrap.dedent("""
        ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
        ld.global.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd2 + 0 ];
    $L__BB0_3:
        ld.global.nc.u32 %r9, [ %rd3 + 0 ];
        @%p1 bra $L__BB0_3;
    """)
    p = occ.parse_ptx(ptx)
    assert not p["has_loop"] and p["load_bytes"] == 36


def test_sass_reader_counts_spills_and_ignores_the_closing_self_branch():
    sass = textwrap.dedent("""
            /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
            /*0010*/                   STL [R1], R4 ;
            /*0020*/                   LDL R5, [R1] ;
            /*0030*/              @!P0 STG.E.128 desc[UR4][R6.64], R4 ;
            /*0040*/                   EXIT ;
    .L_x_0:
            /*0050*/                   BRA `(.L_x_0);
            /*0060*/                   NOP;
    """)
    s = occ.parse_sass(sass)
    assert s == {"spill_stores": 1, "spill_loads": 1, "instructions": 6}


def test_littles_law_by_hand():
    # 4 warps, 40 registers: 12 programs per SM. 8 KiB read per program, 100 instructions a pass.
    res = _res(4, 40, instructions_per_pass=100)
    dev = occ.H200
    est = occ.estimate(res, dev, programs=12 * dev.sms * 3 // 2, read_bytes=1e9, write_bytes=1e9,
                       read_bytes_per_pass=8192)
    assert est.resident == 12 and est.waves == pytest.approx(1.5) and est.tail_efficiency == pytest.approx(0.75)
    assert est.in_flight_per_sm == 12 * 8192
    read_rate = 4249 / 132 * 0.5  # bytes per ns one SM reads at the copy rate, half of the bytes being reads
    assert est.needed_per_sm == pytest.approx(read_rate * 700)
    own = 100 * 1 / 1.98  # one warp per scheduler: 100 issue slots
    assert est.own_ns == pytest.approx(own)
    assert est.latency_fraction == pytest.approx(min(1.0, 12 * 8192 / (700 + own) / read_rate))
    issue_us = 12 * 132 * 1.5 * 100 * 4 / (132 * 4 * 1.98e3)
    assert est.issue_us == pytest.approx(issue_us)
    assert est.memory_us == pytest.approx(2e9 / 4249e3)
    assert est.bound == pytest.approx(min(est.latency_fraction, est.issue_fraction) * 0.75)
    # One program per SM reading 4 KiB a pass cannot cover the latency: about a third of the copy rate.
    slow = occ.estimate(_res(16, 128, instructions_per_pass=300), dev, programs=132, read_bytes=1e9,
                        write_bytes=1e9, read_bytes_per_pass=4096, passes=100)
    assert slow.resident == 1 and slow.latency_fraction == pytest.approx(4096 / (700 + 300 * 4 / 1.98) / read_rate)
    assert slow.latency_fraction < 0.3


KNOWN = textwrap.dedent('''
    import json, torch, triton, triton.language as tl
    from apex.testing.occupancy import capture, resources

    @triton.jit
    def copy(X, Y, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + o, tl.load(X + o, mask=o < n), mask=o < n)

    @triton.jit
    def gather(X, Y, n, stride, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(Y + o, tl.load(X + o * stride, mask=o < n), mask=o < n)

    @triton.jit
    def rowsum(X, Y, V, BLOCK: tl.constexpr, STAGES: tl.constexpr):
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            cols = start + tl.arange(0, BLOCK)
            acc += tl.load(X + tl.program_id(0).to(tl.int64) * V + cols, mask=cols < V, other=0.0)
        tl.store(Y + tl.program_id(0), tl.sum(acc))

    @triton.jit
    def hold(X, Y, BLOCK: tl.constexpr):
        # 16384 fp32 values held across a reduction by one warp: 512 a thread, more than 255 registers.
        o = tl.arange(0, BLOCK)
        x = tl.load(X + o)
        tl.store(Y + o, x / tl.sum(x * x))

    x = torch.empty(1 << 20)
    out = {}
    with capture("cuda:90") as L:
        copy[(256,)](x, torch.empty_like(x), x.numel(), BLOCK=4096, num_warps=4)
        gather[(64,)](x, torch.empty_like(x), x.numel() // 4, 3, BLOCK=4096, num_warps=4)
        rowsum[(64,)](x, torch.empty(64), 16384, BLOCK=2048, STAGES=3, num_warps=4)
        hold[(1,)](x, torch.empty_like(x), BLOCK=16384, num_warps=1)
    for launch in L:
        r = resources(launch.kernel)
        out[launch.name.rsplit(".", 1)[-1]] = {
            "grid": launch.grid, "warps": r.num_warps, "regs": r.regs, "loads": dict(r.loads),
            "stores": dict(r.stores), "vec": r.vector_fraction, "pass": r.load_bytes_per_pass * r.threads,
            "spills": r.spill_stores, "local": r.local_bytes, "loop": r.has_loop, "depth": r.passes_in_flight}
    print(json.dumps(out))
''')


@pytest.fixture(scope="module")
def known(tmp_path_factory):
    pytest.importorskip("triton")
    path = tmp_path_factory.mktemp("occ") / "known.py"
    path.write_text(KNOWN)
    proc = run_uninterpreted([str(path)], cwd=path.parent, timeout=600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_copy_moves_16_byte_vectors(known):
    k = known["copy"]
    # 4096 fp32 over 128 threads: 32 a thread, eight 16-byte loads and stores each; 16 KiB a program.
    assert k["grid"] == [256, 1, 1] and k["warps"] == 4
    assert k["loads"] == {"16": 8} and k["stores"] == {"16": 8} and k["vec"] == 1.0
    assert k["pass"] == 16384 and not k["loop"] and k["spills"] == 0 and k["local"] == 0
    assert 0 < k["regs"] <= 64


def test_a_strided_gather_is_not_vectorised(known):
    k = known["gather"]
    assert k["loads"] == {"4": 32} and k["vec"] == 0.0 and k["stores"] == {"16": 8}


def test_a_pipelined_loop_keeps_two_passes_in_flight(known):
    k = known["rowsum"]
    # tl.range(num_stages=3): cp.async copies two passes ahead; one pass is 2048 fp32 = 8 KiB a program.
    assert k["loop"] and k["depth"] == 2 and k["pass"] == 8192


def test_a_tile_beyond_the_register_file_spills(known):
    k = known["hold"]
    assert k["warps"] == 1 and k["spills"] > 0 and k["local"] > 0
