"""Softmax cross entropy with label smoothing (``apex.ops.xentropy``) at vocabularies of 32K and 128K.

CPU time against ``F.cross_entropy(reduction="none", label_smoothing=0.1, ignore_index=0)``, forward and
backward. Memory: the bytes each keeps alive between forward and backward (saved tensors other than the
logits) and the modelled peak of a training step, ``logits + saved + gradient buffer`` (``inplace_backward``
writes the gradient into the logits, so it adds no buffer). Triton bytes and launches are counted under the
interpreter at (16 × 32768) and (4 × 131072) fp32. Minimum: forward reads the logits and labels and writes
two fp32 values per row; backward reads the logits, labels, lse and grad and writes the gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks._harness import Case, Counted

TIMED = {32768: 256, 131072: 64}  # vocab -> rows (8M logits each)
COUNTED = {32768: 16, 131072: 4}
SMOOTHING = 0.1


def _inputs(m, v, grad=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, v, generator=g) * 2
    lab = torch.randint(0, v, (m,), generator=g)
    lab[::7] = 0
    if grad:
        x.requires_grad_()
    return x, lab


def _ours(x, lab, inplace=False):
    from apex.ops.xentropy import softmax_cross_entropy

    return softmax_cross_entropy(x, lab, SMOOTHING, 0, False, inplace)


def _theirs(x, lab):
    return F.cross_entropy(x, lab, reduction="none", ignore_index=0, label_smoothing=SMOOTHING)


def _saved_bytes(fn, x) -> int:
    """Bytes of the tensors autograd keeps for the backward, other than ``x`` itself."""
    held: dict[int, int] = {}

    def pack(t):
        held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    held.pop(x.untyped_storage().data_ptr(), None)
    return sum(held.values())


def _memory_facts(m, v) -> dict:
    x, lab = _inputs(m, v, grad=True)
    inner = x * 1  # a non-leaf, as the output of a projection layer would be
    ours = _saved_bytes(lambda: _ours(inner, lab), inner)
    theirs = _saved_bytes(lambda: _theirs(inner, lab), inner)
    logits = inner.nbytes
    return {"saved_bytes_ours": ours, "saved_bytes_torch": theirs,
            "peak_model_ours": logits + ours + logits, "peak_model_ours_inplace": logits + ours,
            "peak_model_torch": logits + theirs + logits}


def _fwd_timed(m, v):
    x, lab = _inputs(m, v)
    return (lambda: _ours(x, lab)), (lambda: _theirs(x, lab)), _memory_facts(m, v)


def _bwd_timed(m, v):
    x, lab = _inputs(m, v, grad=True)
    g = torch.randn(m)
    ours = _ours(x, lab)
    ref = _theirs(x, lab)
    return (lambda: torch.autograd.grad(ours, x, g, retain_graph=True),
            lambda: torch.autograd.grad(ref, x, g, retain_graph=True))


def _fwd_counted(m, v):
    x, lab = _inputs(m, v)
    return Counted(triton=lambda: _ours(x, lab), eager=lambda: _theirs(x, lab),
                   bytes_min=x.nbytes + lab.nbytes + 8 * m, note="eager = F.cross_entropy")


def _bwd_counted(m, v):
    import apex

    x, lab = _inputs(m, v, grad=True)
    g = torch.randn(m)
    with apex.backend("triton"):
        y = _ours(x, lab)
    y_eager = _theirs(x, lab)
    return Counted(triton=lambda: torch.autograd.grad(y, x, g, retain_graph=True),
                   eager=lambda: torch.autograd.grad(y_eager, x, g, retain_graph=True),
                   bytes_min=2 * x.nbytes + lab.nbytes + 8 * m, note="eager = F.cross_entropy backward")


def cases() -> list[Case]:
    out = []
    for v, m in TIMED.items():
        cm = COUNTED[v]
        out.append(Case(f"xentropy_fwd_{m}x{v}", timed=lambda m=m, v=v: _fwd_timed(m, v),
                        counted=lambda cm=cm, v=v: _fwd_counted(cm, v), torch_label="F.cross_entropy",
                        repeats=5))
        out.append(Case(f"xentropy_bwd_{m}x{v}", timed=lambda m=m, v=v: _bwd_timed(m, v),
                        counted=lambda cm=cm, v=v: _bwd_counted(cm, v), torch_label="F.cross_entropy backward",
                        repeats=5))
    return out


# ----------------------------------------------------------------------------- GPU-sized cases (--device cuda)
GPU_SHAPES = [(8192, 128256)]  # tokens x Llama-3 vocabulary


def _gpu_inputs(shape, dtype, device):
    from benchmarks._gpu import generator, randn

    m, v = shape
    g = generator(device)
    labels = torch.randint(0, v, (m,), generator=g, device=device)
    return {"x": randn((m, v), dtype, device, g, 2.0), "labels": labels}


def gpu_bytes(shape, dtype, mode) -> int:
    """Forward and backward of the mean loss: read the logits and labels once, write the gradient once (a
    one-pass kernel that writes the gradient while it computes the loss, as Liger's, can reach this)."""
    m, v = shape
    return 2 * m * v * dtype.itemsize + 8 * m


def _liger(inputs):
    from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

    from benchmarks._gpu import Impl

    # Liger writes the gradient into the logits during the forward: these inputs are its own.
    x, lab = inputs["x"], inputs["labels"]
    return Impl(forward=lambda: LigerCrossEntropyFunction.apply(x, lab, None, -100, 0.0, 0.0, "mean")[0],
                leaves=(x,))


def gpu_cases(shapes=GPU_SHAPES, dtypes=None) -> list:
    from benchmarks._gpu import DTYPES, liger_available, op_cases

    def apex_ce(i):
        # Per-row losses in fp32 (half_to_float), averaged: the mean loss, as F.cross_entropy's default.
        return _ours_mean(i["x"], i["labels"])

    return op_cases("cross_entropy", shapes, dtypes or DTYPES, ("fwdbwd",), _gpu_inputs,
                    {"apex": apex_ce, "torch": lambda i: F.cross_entropy(i["x"], i["labels"])}, gpu_bytes, ("x",),
                    builders={"liger": _liger} if liger_available() else None,
                    note="mean loss, no label smoothing; forward and backward timed together")


def _ours_mean(x, lab):
    from apex.ops.xentropy import softmax_cross_entropy

    return softmax_cross_entropy(x, lab, 0.0, None, True).mean()
