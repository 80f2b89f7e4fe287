"""What a compiled Triton kernel asks of an NVIDIA SM, and whether that can keep DRAM busy.

A memory-bound kernel reaches the bandwidth only if enough bytes are requested and not yet returned at
any moment (Little's law): bytes in flight per SM >= (bytes per second per SM) x (DRAM latency). What a
launch keeps in flight follows from its compiled code: the registers and shared memory of one program
decide how many programs an SM holds at once, and each holds the loads of one pass of its body (the
tile it reads before it needs any of it). This module reads those facts from a kernel compiled without a
GPU (:func:`capture`, built on :func:`apex.testing.triton_compile.compile_only`) and turns them into that
estimate (:func:`estimate`)::

    with capture("cuda:90") as launches:
        some_launcher(cpu_tensors)          # compiles for sm_90, runs nothing
    res = resources(launches[0].kernel)      # registers, spills, shared memory, load widths, ...
    est = estimate(res, H200, programs=launches[0].programs, read_bytes=..., write_bytes=...)
    print(res.summary(), est.summary(), sep="\\n")

    python -m apex.testing.occupancy --calls benchmarks.sweep_kernels:calls   # every case, one table

Facts come from the cubin (``cuobjdump --dump-resource-usage``: registers, local memory, static shared
memory), its SASS (``nvdisasm``: spill instructions ``STL``/``LDL``, instruction counts) and the PTX (global
load and store widths). The compiler here may differ from the GPU machine's (another Triton, another
``ptxas``); the figures are those of the Triton installed where this runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Device:
    """Per-SM limits of a GPU (CUDA occupancy calculator terms) and its memory system."""

    name: str
    sms: int
    copy_gbps: float  # device-to-device copy, bytes read + written per second / 1e9
    latency_ns: float = 700.0  # DRAM load latency seen by an SM (600-800 ns idle on Hopper; more when loaded)
    clock_ghz: float = 1.98
    regs_per_sm: int = 65536
    reg_unit: int = 256  # registers are allocated per warp in units of 256
    partitions: int = 4  # the register file is split between 4 schedulers, each holding whole warps
    smem_per_sm: int = 233472  # 228 KiB
    smem_reserved_per_block: int = 1024  # the driver's 1 KiB per block on sm_80 and later
    smem_unit: int = 128
    warps_per_sm: int = 64
    blocks_per_sm: int = 32
    issue_per_clock: int = 4  # one warp instruction per scheduler per clock

    @property
    def bytes_per_ns_per_sm(self) -> float:
        return self.copy_gbps / self.sms


# H200: 4,249 GB/s is a measured 1 GiB copy (triton.testing.do_bench median). H100 SXM (3.35 TB/s HBM3): not
# measured here; 88% of the datasheet, the fraction the H200's copy reaches of its 4.8 TB/s.
H200 = Device("NVIDIA H200", 132, 4249.0)
H100 = Device("NVIDIA H100 80GB HBM3", 132, 2950.0)
DEVICES = {"h200": H200, "h100": H100}


def device_for(name: str) -> Device:
    """The :class:`Device` whose name matches ``name`` (``torch.cuda.get_device_name`` or a short key)."""
    low = name.lower()
    for key, dev in DEVICES.items():
        if key in low or dev.name.lower() == low:
            return dev
    raise ValueError(f"no device model for {name!r}; known: {sorted(DEVICES)}")


# ----------------------------------------------------------------------------- facts from the compiled code
_PTX_MEM = re.compile(r"\b(ld|st)\.global((?:\.[a-z0-9]+)*)")
_PTX_ASYNC = re.compile(r"\bcp\.async\.c[ag]\.shared\.global\S*\s+\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
_PTX_WAIT = re.compile(r"\bcp\.async\.wait_group\s+(\d+)")
_PTX_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_PTX_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);")
_SASS_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b.*`?\(?(\.L_x_\d+)\)?")
_TYPE_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8, "128": 16}


def _access_bytes(suffixes: str) -> int:
    """Bytes one thread moves with one ``ld/st.global<suffixes>`` (``.v4.b32`` -> 16)."""
    parts = suffixes.strip(".").split(".")
    vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
    size = next((_TYPE_BYTES[p[1:]] for p in parts if re.fullmatch(r"[bfsu](8|16|32|64|128)", p)), 4)
    return vec * size


def _loop_bodies(lines: list[str], label_re, branch_re) -> list[tuple[int, int]]:
    """(first, last) line ranges of loops: a label and a later branch back to it."""
    where = {}
    loops = []
    for i, line in enumerate(lines):
        m = label_re.match(line)
        if m:
            where[m.group(1)] = i
        b = branch_re.search(line)
        if b and b.group(1) in where and where[b.group(1)] < i:
            loops.append((where[b.group(1)], i))
    return loops


def _main_loop(loops: list[tuple[int, int]], weight: list[int], prologue: list[bool] | None = None) -> range:
    """The lines of one pass: the loop that loads the most, if it holds at least half of the kernel's loads
    (not a library routine's loop, such as the range reduction of ``sin``, nor SASS's closing self-branch);
    otherwise the whole kernel. ``prologue``: lines that prefetch the loop's first passes (``cp.async``
    outside it), not counted in the kernel's loads."""
    inside = {i for a, b in loops for i in range(a, b + 1)}
    total = sum(w for i, w in enumerate(weight) if i in inside or not (prologue and prologue[i]))
    best = max(loops, key=lambda r: sum(weight[r[0]:r[1] + 1]), default=None)
    if best is None or total == 0 or 2 * sum(weight[best[0]:best[1] + 1]) < total:
        return range(len(weight))
    return range(best[0], best[1] + 1)


@dataclass
class Resources:
    """What one program of a compiled kernel takes and does. ``*_per_pass``: per thread, over the body of
    the loop that loads the most (the whole kernel when it has no loop): what a program keeps in flight."""

    kernel: str
    num_warps: int
    num_stages: int
    regs: int
    local_bytes: int  # per thread: spilled registers and local arrays
    spill_stores: int  # STL instructions in the SASS
    spill_loads: int  # LDL instructions
    shared: int  # bytes per block: Triton's dynamic shared memory plus the cubin's static
    loads: Counter = field(default_factory=Counter)  # bytes per access -> count of ld.global in the PTX
    stores: Counter = field(default_factory=Counter)
    load_bytes_per_pass: int = 0
    store_bytes_per_pass: int = 0
    instructions_per_pass: int = 0  # SASS instructions (per warp) in the same body
    barriers_per_pass: int = 0
    has_loop: bool = False
    passes_in_flight: int = 1  # > 1: the loop's loads are cp.async copies issued that many passes ahead

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def spills(self) -> bool:
        return bool(self.spill_stores or self.spill_loads or self.local_bytes)

    @property
    def vector_fraction(self) -> float:
        """Share of the global bytes loaded by 16-byte accesses (1.0: every load is a 128-bit one)."""
        total = sum(b * n for b, n in self.loads.items())
        return sum(b * n for b, n in self.loads.items() if b >= 16) / total if total else 1.0

    def summary(self) -> str:
        widths = lambda c: ",".join(f"{n}x{b}B" for b, n in sorted(c.items(), reverse=True)) or "-"  # noqa: E731
        return (f"{self.kernel}: {self.num_warps} warps, {self.num_stages} stages, {self.regs} regs/thread, "
                f"spills {self.spill_stores} st/{self.spill_loads} ld ({self.local_bytes} B local), "
                f"shared {self.shared} B, loads {widths(self.loads)}, stores {widths(self.stores)}, "
                f"per pass {self.load_bytes_per_pass * self.threads} B loaded / program, "
                f"{self.instructions_per_pass} instr/warp, {self.barriers_per_pass} barriers"
                + (f", {self.passes_in_flight} passes in flight" if self.passes_in_flight > 1 else ""))


def _tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def parse_ptx(ptx: str) -> dict:
    """Global load/store widths of the whole kernel and per thread in the loop body that loads the most."""
    lines = ptx.splitlines()
    loads, stores = Counter(), Counter()
    per_line = []
    for line in lines:
        m = _PTX_MEM.search(line)
        kind, nbytes = (m.group(1), _access_bytes(m.group(2))) if m else (None, 0)
        if not m and (a := _PTX_ASYNC.search(line)):  # a pipelined load: global -> shared, asynchronously
            kind, nbytes = "ld", int(a.group(1), 0)
        if kind:
            (loads if kind == "ld" else stores)[nbytes] += 1
        per_line.append((kind, nbytes, "bar.sync" in line or "barrier.sync" in line))
    body = _main_loop(_loop_bodies(lines, _PTX_LABEL, _PTX_BRANCH), [b if k == "ld" else 0 for k, b, _ in per_line],
                      ["cp.async" in line for line in lines])
    groups = max(1, sum("cp.async.commit_group" in lines[i] for i in body))
    return {"loads": loads, "stores": stores, "has_loop": len(body) < len(lines),
            # The loop commits g groups of cp.async copies a pass and waits until at most N are pending:
            # N // g + 1 passes' copies are outstanding before the wait.
            "prefetch": max((int(w.group(1)) // groups + 1 for i in body if (w := _PTX_WAIT.search(lines[i]))),
                            default=1),
            "load_bytes": sum(per_line[i][1] for i in body if per_line[i][0] == "ld"),
            "store_bytes": sum(per_line[i][1] for i in body if per_line[i][0] == "st"),
            "barriers": sum(per_line[i][2] for i in body)}


def parse_sass(sass: str) -> dict:
    """Spill instructions of the whole kernel, instructions in the longest loop (or the whole kernel)."""
    lines = sass.splitlines()
    ops = [(m.group(1) if (m := _SASS_INSTR.search(line)) else None) for line in lines]
    body = _main_loop(_loop_bodies(lines, _SASS_LABEL, _SASS_BRANCH),
                      [1 if o and o.startswith("LDG") and o != "LDGDEPBAR" else 0 for o in ops],
                      [bool(o and o.startswith("LDGSTS")) for o in ops])
    real = [ops[i] for i in body if ops[i] and ops[i] != "NOP"]
    return {"spill_stores": sum(1 for o in ops if o and o.startswith("STL")),
            "spill_loads": sum(1 for o in ops if o and o.startswith("LDL")),
            "instructions": len(real)}


def parse_resource_usage(text: str) -> dict:
    """``cuobjdump --dump-resource-usage``'s line for the (single) function."""
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", text)
    if not m:
        raise ValueError(f"no resource usage in cuobjdump output: {text[-300:]!r}")
    reg, stack, shared, local = map(int, m.groups())
    return {"regs": reg, "stack": stack, "static_shared": shared, "local": local}


def resources(kernel, name: str | None = None) -> Resources:
    """The :class:`Resources` of a Triton ``CompiledKernel`` compiled for an NVIDIA target."""
    md = kernel.metadata
    if getattr(md, "backend_name", "cuda") != "cuda" or "cubin" not in kernel.asm:
        raise ValueError("resources() reads NVIDIA cubins; compile for a 'cuda:<arch>' target")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
    ru, ptx, sa = parse_resource_usage(usage), parse_ptx(kernel.asm["ptx"]), parse_sass(sass)
    return Resources(
        kernel=name or md.name, num_warps=int(md.num_warps), num_stages=int(md.num_stages), regs=ru["regs"],
        local_bytes=ru["local"] + ru["stack"], spill_stores=sa["spill_stores"], spill_loads=sa["spill_loads"],
        shared=int(md.shared) + ru["static_shared"], loads=ptx["loads"], stores=ptx["stores"],
        load_bytes_per_pass=ptx["load_bytes"], store_bytes_per_pass=ptx["store_bytes"],
        instructions_per_pass=sa["instructions"], barriers_per_pass=ptx["barriers"], has_loop=ptx["has_loop"],
        passes_in_flight=ptx["prefetch"] if ptx["has_loop"] else 1)


# ----------------------------------------------------------------------------- the model
def occupancy(res: Resources, dev: Device = H200) -> tuple[int, str]:
    """(programs resident per SM, what limits it: ``warps``, ``registers``, ``shared`` or ``blocks``)."""
    warps = res.num_warps
    regs_per_warp = math.ceil(max(res.regs, 1) * 32 / dev.reg_unit) * dev.reg_unit
    warps_by_regs = (dev.regs_per_sm // dev.partitions // regs_per_warp) * dev.partitions
    smem = math.ceil((res.shared + dev.smem_reserved_per_block) / dev.smem_unit) * dev.smem_unit
    limits = {"warps": dev.warps_per_sm // warps, "registers": warps_by_regs // warps,
              "shared": dev.smem_per_sm // smem, "blocks": dev.blocks_per_sm}
    limiter = min(limits, key=lambda k: limits[k])
    return limits[limiter], limiter


@dataclass
class Estimate:
    """The model's answer for one launch; every ``*_fraction`` is a share of the copy rate, an upper bound.

    * ``latency_fraction`` (Little's law with the duty cycle): each resident program repeats "issue the
      loads of a pass, wait ``latency``, run the pass's instructions" (``own_ns``; with ``cp.async``
      prefetching several passes overlap), so an SM reads at most ``resident x bytes per pass / (latency
      + own_ns)``; against the read rate the copy rate implies.
    * ``issue_fraction``: the memory time over the time the SMs need just to issue every warp's SASS
      instructions (4 per SM per clock; dependent instructions, barriers and shuffles issue slower).
    * ``bound``: the smaller of the two times the tail-wave efficiency (a partial last wave leaves SMs idle).
    """

    resident: int
    limiter: str
    programs: int
    waves: float
    tail_efficiency: float
    in_flight_per_sm: float  # bytes of loads outstanding per SM when every resident program is loading
    needed_per_sm: float  # Little's law: the SM's share of the copy rate's reads x latency
    own_ns: float  # one pass's instructions issued by one program alone
    latency_fraction: float
    issue_us: float  # every program's SASS instructions over the SMs' issue rate
    memory_us: float  # the launch's bytes at the copy rate
    issue_fraction: float
    bound: float

    def summary(self) -> str:
        return (f"{self.resident} programs/SM ({self.limiter}), {self.programs} programs = {self.waves:.2f} waves "
                f"(tail {self.tail_efficiency:.2f}); {self.in_flight_per_sm / 1024:.0f} KiB in flight/SM vs "
                f"{self.needed_per_sm / 1024:.0f} KiB needed, pass {self.own_ns:.0f} ns + latency -> "
                f"{100 * self.latency_fraction:.0f}%; issue {self.issue_us:.0f} us vs memory {self.memory_us:.0f} us "
                f"-> {100 * self.issue_fraction:.0f}%; bound {100 * self.bound:.0f}% of copy")


def estimate(res: Resources, dev: Device = H200, *, programs: int, read_bytes: float, write_bytes: float,
             passes: int = 1, read_bytes_per_pass: float | None = None, latency_ns: float | None = None) -> Estimate:
    """Model one launch of ``programs`` programs that together read ``read_bytes`` and write ``write_bytes``
    from DRAM, each program doing ``passes`` passes of its body. ``read_bytes_per_pass``: the DRAM bytes one
    pass of one program reads (default: the PTX's loads of the body, which also counts re-reads that hit
    L1/L2, e.g. a weight row)."""
    resident, limiter = occupancy(res, dev)
    sms = dev.sms
    waves = programs / (resident * sms)
    # A partial last wave runs on fewer SMs (the launch lasts ceil(waves) wave-times); under one wave, the
    # programs that exist are all resident at once, on min(programs, SMs) SMs.
    tail = waves / math.ceil(waves) if waves >= 1 else min(1.0, programs / sms)
    present = min(resident, math.ceil(programs / sms))
    per_pass = read_bytes_per_pass if read_bytes_per_pass is not None else res.load_bytes_per_pass * res.threads
    in_flight = present * per_pass * res.passes_in_flight
    total = read_bytes + write_bytes
    read_share = read_bytes / total if total else 1.0
    lat = latency_ns if latency_ns is not None else dev.latency_ns
    read_rate = dev.bytes_per_ns_per_sm * read_share  # bytes per ns one SM must read to keep up with the copy
    needed = read_rate * lat
    own = res.instructions_per_pass * math.ceil(res.num_warps / dev.issue_per_clock) / dev.clock_ghz
    depth = res.passes_in_flight
    achievable = present * per_pass * min(depth / (lat + own), 1.0 / own if own else math.inf)
    latency_fraction = min(1.0, achievable / read_rate) if read_rate else 1.0
    warp_instr = programs * passes * res.instructions_per_pass * res.num_warps
    issue_us = warp_instr / (sms * dev.issue_per_clock * dev.clock_ghz * 1e3)
    memory_us = total / (dev.copy_gbps * 1e3)
    issue_fraction = min(1.0, memory_us / issue_us) if issue_us else 1.0
    return Estimate(resident, limiter, programs, waves, tail, in_flight, needed, own, latency_fraction, issue_us,
                    memory_us, issue_fraction, min(latency_fraction, issue_fraction) * tail)


# ----------------------------------------------------------------------------- capturing launches
@dataclass
class Launch:
    """One kernel launch captured by :func:`capture`: its compiled kernel, grid and keyword arguments."""

    name: str
    kernel: object
    grid: tuple
    kwargs: dict

    @property
    def programs(self) -> int:
        return math.prod(self.grid)


@contextlib.contextmanager
def capture(target: str = "cuda:90") -> Iterator[list[Launch]]:
    """Within the block every Triton launch compiles for ``target`` (nothing runs; see
    :func:`apex.testing.triton_compile.compile_only`) and is appended to the yielded list."""
    from triton.runtime.jit import JITFunction

    from apex.testing.triton_compile import compile_only

    launches: list[Launch] = []
    with compile_only(target):
        inner = JITFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            kernel = inner(self, *args, grid=grid, warmup=warmup, **kwargs)
            if kernel is not None:
                if callable(grid):
                    grid = grid({**dict(zip(self.arg_names, args)), **kwargs})
                grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
                launches.append(Launch(f"{self.fn.__module__}.{self.fn.__name__}", kernel, grid, dict(kwargs)))
            return kernel

        JITFunction.run = run
        try:
            yield launches
        finally:
            JITFunction.run = inner


def report(calls, target: str = "cuda:90", select: str = "", dev: Device = H200) -> list[str]:
    """One line per launch of ``calls()`` (``(name, fn)`` pairs whose name contains ``select``): the grid and
    the compiled kernel's resources (``benchmarks/sweep_kernels.py --model`` adds each case's bytes and the
    model). CPU tensors launch as on ``dev`` (its SM count sizes persistent grids)."""
    from apex._backend import backend
    from apex._kernels import _tuning

    lines = []
    for name, call in calls():
        if select not in name:
            continue
        with capture(target) as launches, backend("triton"), _tuning.assume_device(dev.name, dev.sms):
            call()
        for launch in launches:
            res = resources(launch.kernel, launch.name.rsplit(".", 1)[-1])
            lines.append(f"{name} {launch.grid}: {res.summary()}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", required=True, metavar="MODULE:FUNCTION",
                   help="a function returning (name, callable) pairs whose launches are compiled")
    p.add_argument("--target", default="cuda:90")
    p.add_argument("-k", default="", help="only calls whose name contains this text")
    args = p.parse_args(argv)
    module, _, attr = args.calls.partition(":")
    if not attr:
        p.error(f"--calls must look like MODULE:FUNCTION, got {args.calls!r}")
    for line in report(getattr(importlib.import_module(module), attr), args.target, args.k):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
