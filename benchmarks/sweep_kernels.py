"""Time every candidate launch configuration of apex's memory-bound kernels on one GPU; keep the fastest.

    python benchmarks/sweep_kernels.py                    # on a GPU: every op and shape of issue 34 (bf16)
    python benchmarks/sweep_kernels.py -k norm --budget 90 --write
    python benchmarks/sweep_kernels.py --model            # no GPU: the occupancy model of every candidate
    python benchmarks/sweep_kernels.py --list

A case is one launcher phase (``layer_norm.fwd``, ``rms_norm.bwd``, ``fused_rope.bwd``,
``bias_swiglu.bwd_db``, ``xentropy.fwd``, ...) at one shape; its candidates are the configurations the
launcher accepts through ``apex._kernels._tuning`` (rows per program, warps, pipeline stages, programs per
SM, ...). Each candidate -- and the launcher's own formula -- is timed by ``triton.testing.do_bench``'s
median (``benchmarks/_gpu.py``) around the launcher call, so extra launches (the norms' partial-sum
reduction) count; GB/s is over the case's minimum bytes.

Before timing, worker processes compile every candidate for this GPU ahead of time
(``apex.testing.occupancy.capture``), filling Triton's cache so the timed process only loads kernels, and
return the occupancy model's figures, printed beside the measured ones. Each case is capped (``--case-cap``),
the run stops starting cases after ``--budget`` seconds, and every finished case is written at once
(``--out``/sweep.json, sweep.md): a run cut short keeps what it measured. ``--write`` stores the winners in
``apex/_kernels/_tuned.py`` under this GPU's name, where the launchers look them up.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

BF16, FP16 = torch.bfloat16, torch.float16
TABLE = ROOT / "apex" / "_kernels" / "_tuned.py"
# The shapes of issue 34: the norms (rows x hidden), RoPE sbhd, bias-SwiGLU (rows x 2*hidden), cross-entropy.
NORM_SHAPES = [(16384, 4096), (65536, 1024), (32768, 2048), (8192, 8192), (4096, 16384)]
# Softmax: [b, np, sq, sk] scores, causal (the GPU benchmark's shape).
# FusedAdam, FusedSGD, amp's unscale: (tensors, elements each), fp32 (the GPU benchmark's optimizer cases).
MT_SHAPES = [(100, 1 << 20), (1000, 96 * 1024)]
SHAPES = {"norm": NORM_SHAPES, "rope": [(4096, 4, 32, 128)], "swiglu": [(16384, 16384)], "xent": [(8192, 128256)],
          "softmax": [(1, 128, 2048, 2048)], "adam": [(100, 1 << 20), (24, 4096 * 4096), (1000, 96 * 1024)],
          "sgd": MT_SHAPES, "scale": MT_SHAPES}
SMALL = {"norm": [(48, 256)], "rope": [(6, 2, 4, 32)], "swiglu": [(40, 256)], "xent": [(12, 1000)],
         "softmax": [(1, 2, 40, 40)], "adam": [(3, 5000)], "sgd": [(3, 5000)], "scale": [(3, 5000)]}


@dataclass
class SweepCase:
    op: str  # the launcher's name in apex._kernels._tuning
    shape: tuple[int, ...]
    key: tuple[int, ...]  # the table key: (rows, *sizes)
    dtype: torch.dtype
    read_bytes: int
    write_bytes: int
    make: Callable[[torch.device, bool], dict]  # (device, fill with values) -> inputs
    run: Callable[[dict], object]  # the launcher call(s) of this phase
    candidates: list[dict]
    passes: Callable[[dict, int], int] = lambda cfg, programs: 1  # loop passes of one program (the model)
    pass_bytes: Callable[[dict], int] | None = None  # DRAM bytes one pass of one program reads (the model)

    @property
    def name(self) -> str:
        return f"{self.op} {'x'.join(map(str, self.shape))} {str(self.dtype).removeprefix('torch.')}"

    @property
    def bytes_min(self) -> int:
        return self.read_bytes + self.write_bytes


def _p2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _fill(shape, dtype, device, fill: bool, g=None, scale=1.0, shift=0.0):
    from benchmarks._gpu import randn

    if not fill:
        return torch.empty(shape, dtype=dtype, device=device)
    return randn(shape, dtype, device, g, scale, shift)


# ----------------------------------------------------------------------------- the cases
def _norm_candidates(n: int, backward: bool) -> list[dict]:
    """Rows per program x warps with 8-64 elements per thread (4-32 in the backward, which also holds the
    weight-gradient accumulators in registers), the forward from 16 elements a thread with the weight and bias
    held in registers or read per tile (``wtile``); the backward also over 1-8 programs per SM, and for rows of
    4096 columns and more the column-chunked backward (``_norm_wide``): chunks of 1024 or 2048 columns, 1 or 2
    rows, 8 elements a thread (16-byte loads of 16-bit inputs), 4 or 8 programs' worth per SM."""
    lo, hi = (4, 32) if backward else (8, 64)
    # The former launch: tiles of 4096 elements (up to 16 rows), 16 warps; one program per SM backward.
    rows = max(1, min(16, 4096 // _p2(n)))
    out = [{"rows": rows, "warps": max(1, min(16, rows * _p2(n) // 256)), "programs_per_sm": int(backward)}]
    for rows in ((1, 2) if backward else (1, 2, 4, 8)):
        for warps in (1, 2, 4, 8, 16, 32):
            if lo <= rows * _p2(n) // (32 * warps) <= hi:
                out += [{"rows": rows, "warps": warps, "programs_per_sm": p}
                        for p in ((1, 2, 4, 8) if backward else (0,))]
    out = [c for i, c in enumerate(out) if c not in out[:i]]
    if backward and _p2(n) >= 4096:  # every candidate names its design: the formula may take either there
        out = [{**c, "split": 0} for c in out]
        out += [{"rows": r, "warps": r * s // 256, "programs_per_sm": p, "split": s}
                for s in (1024, 2048) for r in (1, 2) for p in (4, 8)]
    if not backward:  # the parameters held in registers (wtile 0) or read per tile (1), from 16 elements a thread
        out = [{**c, "wtile": w} for c in out
               for w in ((0, 1) if c["rows"] * _p2(n) >= 16 * 32 * c["warps"] else (0,))]
    return out


def _norm_case(shape, dtype, rms: bool, backward: bool, sms: int) -> SweepCase:
    from apex._kernels import _norm

    m, n = shape
    s = dtype.itemsize

    def make(device, fill):
        g = torch.Generator(device=device).manual_seed(0) if fill else None
        i = {"x": _fill((m, n), dtype, device, fill, g), "w": _fill((n,), dtype, device, fill, g, 0.1, 1.0),
             "b": None if rms else _fill((n,), dtype, device, fill, g, 0.1),
             "dy": _fill((m, n), dtype, device, fill, g)}
        _, mean, rstd, _ = _norm.forward(i["x"], i["w"], i["b"], 1e-5, dtype, rms) if fill else (
            None, torch.empty(m, device=device), torch.empty(m, device=device), None)
        i.update(mean=mean if mean is not None else rstd, rstd=rstd)
        return i

    def run(i):
        if backward:
            return _norm.backward(i["dy"], i["x"], i["w"], i["b"], None if rms else i["mean"], i["rstd"], False,
                                  rms, dtype)
        return _norm.forward(i["x"], i["w"], i["b"], 1e-5, dtype, rms)

    params = n * s * (1 if rms else 2)
    read = (2 if backward else 1) * m * n * s + params + (4 if rms else 8) * m * backward
    write = m * n * s + (params if backward else (4 if rms else 8) * m)
    op = ("rms_norm" if rms else "layer_norm") + (".bwd" if backward else ".fwd")
    # The model's launch is the first: with "split", the row-statistics kernel, a tile of rows a program
    # walking the row's column chunks (dy and x: two inputs).
    return SweepCase(op, shape, shape, dtype, read, write, make, run, _norm_candidates(n, backward),
                     passes=lambda cfg, progs: (math.ceil(n / cfg["split"]) if cfg.get("split") else
                                                math.ceil(math.ceil(m / cfg["rows"]) / progs)),
                     pass_bytes=lambda cfg: cfg["rows"] * min(n, cfg.get("split") or n) * s * (2 if backward else 1))


def _rope_case(shape, dtype, backward: bool) -> SweepCase:
    from apex._kernels import fused_rope

    S, B, H, D = shape
    # Both kernels (halves 1: the two half tiles, each element loaded once; 0: the full tile and its partner
    # reload) over the same head blocks and warps; a program reads heads x D elements either way.
    cands = [{"heads": h, "warps": w, "halves": v} for v in (1, 0) for h in (1, 2, 4, 8, 16, 32) if h <= _p2(H)
             for w in (1, 2, 4, 8) if 4 <= h * _p2(D) // (32 * w) <= 64]

    def make(device, fill):
        g = torch.Generator(device=device).manual_seed(0) if fill else None
        return {"x": _fill(shape, dtype, device, fill, g), "y": torch.empty(shape, dtype=dtype, device=device),
                "freqs": _fill((S, D), torch.float32, device, fill, g)}

    def run(i):
        return fused_rope.rope(i["x"], i["y"], 0, backward, D, i["freqs"])

    size = S * B * H * D * dtype.itemsize
    return SweepCase("fused_rope." + ("bwd" if backward else "fwd"), shape, (S * B, H, D), dtype, size + S * D * 4,
                     size, make, run, cands, pass_bytes=lambda cfg: cfg["heads"] * D * dtype.itemsize)


def _swiglu_case(shape, dtype, phase: str) -> SweepCase:
    from apex._kernels import bias_swiglu

    m, n2 = shape
    n, s = n2 // 2, dtype.itemsize
    if phase == "bwd_db":  # column blocks walking their rows (all, or one of "splits" chunks); pipelined or not
        cands = [{"rows": r, "cols": c, "warps": 4, "stages": st, "splits": sp} for c in (32, 64, 128)
                 for r in (16, 32, 64) for st in (1, 3) for sp in (1, 8, 32) if 1024 <= r * c <= 8192]
        bm, bn, _ = bias_swiglu.column_tiles(m, n)  # the former launch: narrow columns, all rows, one pass
        cands.append({"rows": bm, "cols": bn, "warps": 4, "stages": 1, "splits": 1})
    else:
        cands = [{"rows": r, "cols": c, "warps": w} for c in (512, 1024, 2048) for r in (2, 4, 8, 16)
                 for w in (4, 8) if r * c in (4096, 8192)]

    def make(device, fill):
        g = torch.Generator(device=device).manual_seed(0) if fill else None
        return {"x": _fill((m, n2), dtype, device, fill, g), "b": _fill((n2,), dtype, device, fill, g, 0.1),
                "dy": _fill((m, n), dtype, device, fill, g)}

    def run(i):
        if phase == "fwd":
            return bias_swiglu.forward(i["x"], i["b"], dtype)
        if phase == "bwd":
            return bias_swiglu.backward(i["dy"], i["x"], i["b"], dtype)
        return bias_swiglu.backward_with_bias_grad(i["dy"], i["x"], i["b"], dtype)

    x, y = m * n2 * s, m * n * s
    read, write = (x + n2 * s, y) if phase == "fwd" else (x + y + n2 * s, x + n2 * s * (phase == "bwd_db"))
    return SweepCase("bias_swiglu." + phase, shape, shape[:1] + (n,), dtype, read, write, make, run, cands,
                     passes=lambda cfg, progs: (math.ceil(m / cfg.get("splits", 1) / cfg["rows"])
                                                if phase == "bwd_db" else 1),
                     pass_bytes=lambda cfg: cfg["rows"] * cfg["cols"] * s * 3 if phase != "fwd" else None)


def _xent_case(shape, dtype, backward: bool) -> SweepCase:
    from apex._kernels import xentropy

    m, v = shape
    if backward:
        cands = [{"rows": r, "block": b, "warps": w} for r in (1, 2, 4, 8) for b in (1024, 2048, 4096, 8192)
                 for w in (4, 8, 16) if 4096 <= r * b <= 16384 and 8 <= r * b // (32 * w) <= 64]
    else:
        cands = [{"rows": 1, "block": b, "warps": w, "stages": st} for b in (2048, 4096, 8192, 16384)
                 for w in (4, 8, 16) for st in (1, 2, 3) if 16 <= b // (32 * w) <= 64]

    def make(device, fill):
        g = torch.Generator(device=device).manual_seed(0) if fill else None
        x = _fill((m, v), dtype, device, fill, g, 2.0)
        labels = (torch.randint(0, v, (m,), generator=g, device=device) if fill
                  else torch.zeros(m, dtype=torch.long, device=device))
        lse = xentropy.forward(x, labels, 0.0, -100)[1] if fill else torch.empty(m, device=device)
        return {"x": x, "labels": labels, "lse": lse, "g": torch.ones(m, device=device),
                "out": torch.empty_like(x)}

    def run(i):
        if backward:
            return xentropy.backward(i["g"], i["x"], i["labels"], i["lse"], 0.0, -100, i["out"])
        return xentropy.forward(i["x"], i["labels"], 0.0, -100)

    s = dtype.itemsize
    read, write = (m * v * s + 16 * m, m * v * s) if backward else (m * v * s + 8 * m, 8 * m)
    return SweepCase("xentropy." + ("bwd" if backward else "fwd"), shape, shape, dtype, read, write, make, run,
                     cands, passes=lambda cfg, progs: 1 if backward else math.ceil(v / cfg["block"]),
                     pass_bytes=lambda cfg: cfg["rows"] * cfg["block"] * s)


def _softmax_case(shape, dtype, backward: bool) -> SweepCase:
    from apex._kernels import scaled_masked_softmax as sm

    b, h, sq, sk = shape
    n, s = b * h * sq, dtype.itemsize
    # Rows per program x warps with 8-64 keys a thread (each row held in registers, read once); the formula's
    # launch at sk = 2048 is 2 rows x 4 warps.
    cands = [{"rows": r, "warps": w} for r in (1, 2, 4, 8) for w in (1, 2, 4, 8, 16)
             if 8 <= r * _p2(sk) // (32 * w) <= 64]

    def make(device, fill):
        g = torch.Generator(device=device).manual_seed(0) if fill else None
        x = _fill(shape, dtype, device, fill, g, 4.0)
        y = sm.forward(x, None, 0.125, True) if fill else torch.empty(shape, dtype=dtype, device=device)
        return {"x": x, "y": y, "dy": _fill(shape, dtype, device, fill, g)}

    def run(i):
        if backward:
            return sm.backward(i["dy"], i["y"], 0.125, True, dtype)
        return sm.forward(i["x"], None, 0.125, True)

    size = n * sk * s
    # Minimum bytes as the GPU benchmark counts them (the whole square: x, y; dy, y, dx); a causal program
    # reads only the keys up to each row's diagonal, half its rows' length on average (of each input).
    return SweepCase(sm.BWD_OP if backward else sm.FWD_OP, shape, (n, sk, 1), dtype, size * (2 if backward else 1),
                     size, make, run, cands,
                     pass_bytes=lambda cfg: cfg["rows"] * (sk + 1) // 2 * s * (2 if backward else 1))


def _multi_tensor_case(op: str, shape, lists: int, read: int, write: int, prepare, step,
                       absolute: int = -1) -> SweepCase:
    """One fp32 step of the multi-tensor ``op`` over ``tensors`` tensors of ``numel`` elements in ``lists`` lists,
    ``read`` of them read and ``write`` written (one launch, ``mt.parts``' grid): its chunks each split over 1-8
    programs (the last wave of a grid of long programs leaves SMs idle), walked in steps of 512-4096 elements
    with 4-32 elements a thread. Key: the table's (chunks, chunk). ``step(prepare(lists), lists, noop)`` is the
    launch (over tables held as an optimizer holds them); list ``absolute`` holds non-negative values."""
    from apex._kernels import multi_tensor as mt

    count, numel = shape
    chunk = min(mt.MAX_CHUNK, _p2(numel))
    cands = [{"parts": p, "block": b, "warps": w} for p in (1, 2, 4, 8) for b in (512, 1024, 2048, 4096)
             for w in (2, 4, 8) if 4 <= b // (32 * w) <= 32]

    def make(device, fill):
        g = torch.Generator(device=device).manual_seed(0) if fill else None
        ls = []
        for k in range(lists):  # without values (the model, a compile) one buffer at every place of a list
            if fill:
                ls.append([_fill((numel,), torch.float32, device, True, g, 0.1, 0.0).abs_() if k == absolute
                           else _fill((numel,), torch.float32, device, True, g) for _ in range(count)])
            else:
                ls.append([torch.empty(numel, device=device)] * count)
        return {"held": prepare(ls), "noop": torch.zeros(1, dtype=torch.int32, device=device), "lists": ls}

    def run(i):  # (updates the lists in place: what a step does; they are returned for comparisons)
        step(i["held"], i["lists"], i["noop"])
        return i["lists"]

    size = count * numel * 4
    return SweepCase(op, shape, (count * -(-numel // chunk), chunk), torch.float32, read * size, write * size, make,
                     run, cands, passes=lambda cfg, progs: math.ceil(chunk / cfg["parts"] / cfg["block"]),
                     pass_bytes=lambda cfg: cfg["block"] * 4 * read)


def _adam_case(shape) -> SweepCase:
    """FusedAdam's AdamW step: g, p, m, v read; p, m, v written."""
    from apex._kernels import multi_tensor_adam as A

    def step(tabs, lists, noop):
        A.run(tabs, False, noop, None, None, None, 1e-3, 0.1, 0.001, 0.9, 0.999, 1e-8, 0.01, 1, True,
              capturable=False)

    return _multi_tensor_case(A.OP, shape, 4, 4, 3, A.tables, step, absolute=3)


def _sgd_case(shape) -> SweepCase:
    """FusedSGD's step with momentum (not the first): g, w, buf read; w, buf written."""
    from apex._kernels import multi_tensor_sgd as S

    def step(tabs, lists, noop):
        S.run(tabs, False, noop, lr=0.1, wd=1e-4, momentum=0.9, dampening=0.0, nesterov=False, first_run=False,
              wd_after_momentum=False, scale=1.0)

    return _multi_tensor_case(S.OP, shape, 3, 3, 2, S.tables, step)


def _scale_case(shape) -> SweepCase:
    """amp's unscale of fp32 gradients into fp32 master gradients (multi_tensor_scale): one read, one write."""
    from apex._kernels import multi_tensor_scale as SC

    def step(_, lists, noop):
        SC.scale(noop, lists[0], lists[1], 2.0 ** -16)

    return _multi_tensor_case(SC.OP, shape, 2, 1, 1, lambda lists: None, step)


def cases(dtype: torch.dtype = BF16, shapes: dict | None = None, sms: int = 132) -> list[SweepCase]:
    """Every sweep case, in the order they run: forward before backward, one op after another."""
    shapes = shapes or SHAPES
    out = []
    for rms in (False, True):
        for backward in (False, True):
            out += [_norm_case(sh, dtype, rms, backward, sms) for sh in shapes["norm"]]
    for backward in (False, True):
        out += [_rope_case(sh, dtype, backward) for sh in shapes["rope"]]
    for phase in ("fwd", "bwd", "bwd_db"):
        out += [_swiglu_case(sh, dtype, phase) for sh in shapes["swiglu"]]
    for backward in (False, True):
        out += [_xent_case(sh, dtype, backward) for sh in shapes["xent"]]
    for backward in (False, True):
        out += [_softmax_case(sh, dtype, backward) for sh in shapes["softmax"]]
    # (fp32, whatever the others' dtype)
    out += [_adam_case(sh) for sh in shapes.get("adam", ())]
    out += [_sgd_case(sh) for sh in shapes.get("sgd", ())]
    out += [_scale_case(sh) for sh in shapes.get("scale", ())]
    return out


def select(all_cases: list[SweepCase], k: str = "") -> list[SweepCase]:
    return [c for c in all_cases if k in c.name]


def calls(dtype: torch.dtype = BF16):
    """(name, launch) of every case with the launchers' own configuration, on uninitialised CPU tensors: for
    ``python -m apex.testing.occupancy --calls benchmarks.sweep_kernels:calls`` and compile checks."""
    for case in cases(dtype):
        yield case.name, lambda case=case: case.run(case.make(torch.device("cpu"), False))


if __name__ == "__main__":
    from benchmarks._sweep_run import main  # the runner: compiling, the model, timing, the table

    sys.exit(main())
