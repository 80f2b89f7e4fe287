"""RNN-T loss forward + backward: CPU time against plain-PyTorch dynamic programmes; Triton bytes and launches.

PyTorch has no RNN-T loss (torchaudio's is not installed here), so the comparisons are the two ways people
write one in PyTorch: a loop over every lattice cell (t, u), vectorised over the batch, and the same
anti-diagonal recursion as ours but differentiated by autograd. Ours runs the anti-diagonal recursion
without autograd and writes the logits' gradient in one vectorised pass.

Counted under the interpreter at B=2, T=6, U=4, V=32 fp32. Minimum bytes: read the logits once, write
their gradient once (labels, lengths and the loss are negligible). The Triton path reads the logits three
times (row log-sum-exp, the gathers of the recursion, the gradient pass).
"""

from __future__ import annotations

import torch

from benchmarks._harness import Case, Counted

TIMED = [(8, 60, 20, 128), (4, 150, 40, 512)]


def _inputs(B, T, U, V):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, U, V, generator=g).requires_grad_()
    label = torch.randint(0, V - 1, (B, U - 1), generator=g, dtype=torch.int32)
    f_len = torch.randint(T // 2, T + 1, (B,), generator=g, dtype=torch.int32)
    y_len = torch.randint(U // 2, U, (B,), generator=g, dtype=torch.int32)
    f_len[0], y_len[0] = T, U - 1
    return x, label, f_len, y_len


def _cell_loop_loss(x, label, f_len, y_len, blank):
    """Textbook RNN-T in PyTorch: alpha cell by cell (vectorised over the batch), autograd backward."""
    B, T, U, _ = x.shape
    lp = torch.log_softmax(x, -1)
    lpb = lp[..., blank]
    lpl = lp[:, :, :-1].gather(3, label.long().view(B, 1, U - 1, 1).expand(B, T, U - 1, 1)).squeeze(3)
    rows = [[None] * U for _ in range(T)]
    for t in range(T):
        for u in range(U):
            if t == 0 and u == 0:
                rows[t][u] = x.new_zeros(B)
            elif t == 0:
                rows[t][u] = rows[t][u - 1] + lpl[:, t, u - 1]
            elif u == 0:
                rows[t][u] = rows[t - 1][u] + lpb[:, t - 1, u]
            else:
                rows[t][u] = torch.logaddexp(rows[t - 1][u] + lpb[:, t - 1, u], rows[t][u - 1] + lpl[:, t, u - 1])
    alpha = torch.stack([torch.stack(r, 1) for r in rows], 1)
    bi = torch.arange(B)
    t_end, u_end = f_len.long() - 1, y_len.long()
    return -(alpha[bi, t_end, u_end] + lpb[bi, t_end, u_end])


def _diag_autograd_loss(x, label, f_len, y_len, blank):
    """The anti-diagonal recursion with autograd (what one writes after learning the wavefront trick)."""
    B, T, U, _ = x.shape
    lp = torch.log_softmax(x, -1)
    lpb = lp[..., blank]
    lpl = torch.nn.functional.pad(
        lp[:, :, :-1].gather(3, label.long().view(B, 1, U - 1, 1).expand(B, T, U - 1, 1)).squeeze(3), (0, 1),
        value=float("-inf"))
    neg = x.new_full((B, 1), float("-inf"))
    diag = x.new_zeros(B, 1)  # cells (t, u) with t + u = n, indexed by u = 0..min(n, U-1)
    diags = [diag]
    for n in range(1, T + U - 1):
        u = torch.arange(max(0, n - T + 1), min(n, U - 1) + 1)
        t = n - u
        prev_lo = max(0, n - T)
        prev = torch.cat([neg, diags[-1], neg], 1)  # prev[:, k + 1] holds u = prev_lo + k
        from_up = torch.where(t > 0, prev[:, u - prev_lo + 1] + lpb[:, (t - 1).clamp(min=0), u], float("-inf"))
        from_left = torch.where(u > 0, prev[:, u - prev_lo] + lpl[:, t, (u - 1).clamp(min=0)], float("-inf"))
        diags.append(torch.logaddexp(from_up, from_left))
    bi = torch.arange(B)
    t_end, u_end = f_len.long() - 1, y_len.long()
    n_end = t_end + u_end
    out = []
    for b in range(B):
        lo = max(0, int(n_end[b]) - T + 1)
        out.append(diags[int(n_end[b])][b, int(u_end[b]) - lo])
    return -(torch.stack(out) + lpb[bi, t_end, u_end])


def _timed(shape, baseline):
    from apex.ops.transducer_loss import transducer_loss

    x, label, f_len, y_len = _inputs(*shape)
    blank = shape[3] - 1
    ref = _cell_loop_loss if baseline == "cells" else _diag_autograd_loss

    def ours():
        return torch.autograd.grad(transducer_loss(x, label, f_len, y_len, blank).sum(), x)

    def theirs():
        return torch.autograd.grad(ref(x, label, f_len, y_len, blank).sum(), x)

    return ours, theirs


def _counted():
    import apex
    from apex.ops.transducer_loss import transducer_loss

    x, label, f_len, y_len = _inputs(2, 6, 4, 32)

    def triton():
        with apex.backend("triton"):
            return torch.autograd.grad(transducer_loss(x, label, f_len, y_len, 31).sum(), x)

    return Counted(triton=triton,
                   eager=lambda: torch.autograd.grad(_diag_autograd_loss(x, label, f_len, y_len, 31).sum(), x),
                   bytes_min=2 * x.nbytes,
                   note="eager = anti-diagonal recursion with autograd; minimum = read x + write dx")


def cases() -> list[Case]:
    out = []
    for shape in TIMED:
        name = "x".join(map(str, shape))
        out.append(Case(f"transducer_loss_{name}", timed=lambda s=shape: _timed(s, "diag"),
                        counted=_counted if shape == TIMED[0] else None,
                        torch_label="anti-diagonal DP + autograd", repeats=3, warmup=1))
        out.append(Case(f"transducer_loss_{name}_vs_cells", timed=lambda s=shape: _timed(s, "cells"),
                        torch_label="cell-by-cell DP + autograd", repeats=3, warmup=1))
    return out
